"""Load a ninfer request log with pandas: one row per event, timings flattened.

.venv/bin/python examples/log_pandas.py requests.jsonl [more.jsonl ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

# The fields used below: a log without some event (or an empty one) lacks them.
COLUMNS = ["event", "ts_unix_ms", "request_id", "endpoint", "status", "type",
           "completion_tokens", "timings_seconds"]  # fmt: skip


def main(paths: list[str]) -> None:
    frames = [pd.read_json(p, lines=True) for p in paths if Path(p).stat().st_size]
    log = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    log = log.reindex(columns=sorted(set(log.columns) | set(COLUMNS)))
    log["time"] = pd.to_datetime(log["ts_unix_ms"], unit="ms", utc=True)
    print(f"{len(log)} records")
    print(log["event"].value_counts().to_string(), end="\n\n")

    done = log[log["event"] == "request_done"].reset_index(drop=True)
    if done.empty:
        print("no completed requests")
        return
    timings = pd.json_normalize(done["timings_seconds"].tolist()).add_suffix("_s")
    done = pd.concat([done.drop(columns="timings_seconds"), timings], axis=1)
    done = done.astype({"completion_tokens": "int64"})  # NaN elsewhere made it float
    per_endpoint = done.groupby("endpoint").agg(
        n=("request_id", "count"),
        ttft_p50_ms=("ttft_s", lambda s: 1000 * s.quantile(0.5)),
        ttft_p95_ms=("ttft_s", lambda s: 1000 * s.quantile(0.95)),
        total_p95_ms=("total_s", lambda s: 1000 * s.quantile(0.95)),
        tokens=("completion_tokens", "sum"),
    )
    print(per_endpoint.round(1).to_string(), end="\n\n")

    refused = log[log["event"] == "request_rejected"].astype({"status": "int64"})
    if not refused.empty:
        print(refused.groupby(["status", "type"]).size().to_string())


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: log_pandas.py FILE [FILE ...]")
    main(sys.argv[1:])
