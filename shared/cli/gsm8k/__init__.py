"""GSM8K through the queue (`actq gsm8k`).

data.py      problems (a JSONL file, the hub, or built-in samples), prompt styles and formats
             (chat messages or a plain base-model prompt), the default capture (the residual preset)
runner.py    bulk submission, live progress, resume without duplicates, the results directory
scoring.py   answer extraction and scoring as lm-evaluation-harness does it
samples.jsonl  a dozen easy problems in GSM8K's format, written for actq, for offline demos
"""
