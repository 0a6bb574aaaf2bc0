from grpo_jax.cli import main

raise SystemExit(main())
