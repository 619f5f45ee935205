"""The hyperparameter sweep's entry point (tune/sweep.py, a job like jobs/*.py) and its search spaces
(*.yaml); ``from tune import sweep`` imports the job from the repository root."""
