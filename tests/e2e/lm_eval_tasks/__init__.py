"""lm-eval's side of tests/e2e/test_lm_eval.py and bench/bench_lm_eval.py: the task YAMLs (this
folder is lm_eval's `--include_path`), their synthetic data (synthetic.py), lm-eval run in process
(runs.py) and the transformers reference its answers are checked against (reference.py)."""
