"""What a run shows: metrics writers (`writers`), the progress bar (`progress`), plots (`plots`) and
the HTML report (`report`)."""

from grpo_jax.observe.plots import plot_run
from grpo_jax.observe.progress import ProgressBar
from grpo_jax.observe.writers import MetricsWriter, read_metrics, series

__all__ = ["MetricsWriter", "ProgressBar", "plot_run", "read_metrics", "series"]
