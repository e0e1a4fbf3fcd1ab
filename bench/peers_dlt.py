"""One dlt run of bench_items, as a data team would write it: sql_table with the pyarrow
backend, incremental on updated_at, merged on id. The pipeline's state is kept in
DLT_PIPELINES_DIR (and in the destination), so a second run with the same directory is an
incremental run.

usage: peers_dlt.py SOURCE_URL TARGET_URL
"""

import os
import sys

import dlt
from dlt.sources.sql_database import sql_table


def main() -> None:
    source, target = sys.argv[1], sys.argv[2]
    table = sql_table(
        credentials=source,
        table="bench_items",
        schema="public",
        backend="pyarrow",
        incremental=dlt.sources.incremental("updated_at"),
    )
    table.apply_hints(primary_key="id", write_disposition="merge")
    pipeline = dlt.pipeline(
        pipeline_name="tidemark_bench",
        pipelines_dir=os.environ["DLT_PIPELINES_DIR"],
        destination=dlt.destinations.postgres(credentials=target),
        dataset_name="public",
    )
    info = pipeline.run(table)
    print(info)
    if info.has_failed_jobs:
        sys.exit(1)


if __name__ == "__main__":
    main()
