"""Analysis workflows above the diff and the replayer: `trace sweep` (along its dependencies:
sweep_config.py, sweep_worker.py, sweep_pool.py, the driver sweep.py, sweep_report.py; with
prompts.py and corpus.py), `trace sensitivity` and `trace precision` (runner.py,
sensitivity.py, precision.py, recipe.py, sensitivity_report.py) and `trace repro` (repro.py).
Every replay goes through the replay core (replayer/core.py); every metric comes from
diff/metrics.py."""
