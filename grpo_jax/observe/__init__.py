"""What a run shows: metrics writers, the progress bar, plots and the HTML report."""
