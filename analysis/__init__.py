"""Analysis workflows above the diff and the replayer: `trace sweep` (sweep.py, prompts.py,
corpus.py, sweep_report.py), `trace sensitivity` and `trace precision` (runner.py,
sensitivity.py, precision.py, recipe.py, sensitivity_report.py) and `trace repro` (repro.py).
Every replay goes through the replay core (replayer/core.py); every metric comes from
diff/metrics.py."""
