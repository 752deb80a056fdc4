"""Query a ninfer request log with DuckDB: latency percentiles and refusals per endpoint.

.venv/bin/python examples/log_duckdb.py requests.jsonl [more.jsonl ...]

Each line is one JSON object (schema ninfer.request_log v1, docs/request-log.md);
events carry different fields. The columns queried are declared, so any valid log
reads, an empty one or one without some event included (a field a line lacks is
NULL); filter on `event`.
"""

from __future__ import annotations

import sys

import duckdb

# The fields queried below, with their types in the schema.
COLUMNS = """{
    'event': 'VARCHAR', 'endpoint': 'VARCHAR', 'status': 'INTEGER', 'type': 'VARCHAR',
    'stage': 'VARCHAR', 'completion_tokens': 'BIGINT',
    'timings_seconds': 'STRUCT(queue DOUBLE, ttft DOUBLE, total DOUBLE)'
}"""


def show(title: str, cursor: duckdb.DuckDBPyConnection) -> None:
    """A query's result under its column names, one row a line."""
    print(title)
    print("  ", tuple(column[0] for column in cursor.description or ()))
    for row in cursor.fetchall():
        print("  ", row)


def main(paths: list[str]) -> None:
    con = duckdb.connect()
    files = ", ".join("'" + p.replace("'", "''") + "'" for p in paths)
    con.execute(f"CREATE VIEW log AS SELECT * FROM read_ndjson([{files}], columns = {COLUMNS})")
    show(
        "completed requests:",
        con.execute(
            """SELECT endpoint, count(*) AS requests,
                  round(1000 * quantile_cont(timings_seconds.queue, 0.5), 1) AS queue_p50_ms,
                  round(1000 * quantile_cont(timings_seconds.ttft, 0.5), 1) AS ttft_p50_ms,
                  round(1000 * quantile_cont(timings_seconds.ttft, 0.95), 1) AS ttft_p95_ms,
                  round(1000 * quantile_cont(timings_seconds.total, 0.95), 1) AS total_p95_ms,
                  sum(completion_tokens) AS completion_tokens
               FROM log WHERE event = 'request_done' GROUP BY endpoint ORDER BY endpoint"""
        ),
    )
    show(
        "refused:",
        con.execute(
            """SELECT status, type, count(*) AS requests FROM log
               WHERE event = 'request_rejected' GROUP BY ALL ORDER BY status, type"""
        ),
    )
    show(
        "cancelled:",
        con.execute(
            """SELECT stage, count(*) AS requests FROM log
               WHERE event = 'request_cancelled' GROUP BY ALL ORDER BY stage"""
        ),
    )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: log_duckdb.py FILE [FILE ...]")
    main(sys.argv[1:])
