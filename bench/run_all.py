"""`make bench`: run every bench/bench_*.py in turn (each with a timeout) and print their figures.

    .venv/bin/python bench/run_all.py
"""
import subprocess
import sys
from pathlib import Path

for script in sorted(Path(__file__).resolve().parent.glob("bench_*.py")):
    print(f"== {script.name}", flush=True)
    try:
        subprocess.run([sys.executable, str(script)], check=False, timeout=1200)
    except subprocess.TimeoutExpired:
        print(f"{script.name}: timed out after 1200 s", flush=True)
