#!/usr/bin/env python3
"""Read a trajflow run's Parquet snapshots with pyarrow and DuckDB.

Usage:
    examples/analyst/setup.sh                      # once: .venv/ with pyarrow, duckdb, numpy
    .venv/bin/python examples/analyst/analyze.py SNAPSHOT_DIR [--run RUN] [--ipc FILE] [--check]

SNAPSHOT_DIR is the directory the snapshot operator writes
(`trajflow run snapshot --snapshot-dir DIR`, `trajflow demo --out DIR`, or
`trajflow up --out OUT`'s OUT/snapshots, which OUT also finds).
It is partitioned Hive-style:

    DIR/run=<run>/topic=<topic>/partition=<p>/<first offset>-<last offset>.parquet

so one glob reads a topic of a whole run (DIR/run=<run>/topic=valid/partition=*/*.parquet),
and one glob reads every topic of the run (DIR/run=<run>/topic=*/partition=*/*.parquet, with
hive partitioning and union_by_name in DuckDB: the topics' schemas differ). The run's task
registry sits beside them, DIR/run=<run>/tasks.parquet, outside the topic= tree: a glob of
every *.parquet under the run (**) would mix it in. The control topics (census, incidents,
policy, windows, quarantine) share one set of columns: a column a topic's documents do not
have reads as 0, "" or false (never null), so query each topic with its own columns, or
parse _value (the JSON document itself).
Every file keeps the Arrow schema trajflow wrote (token ids are int32 lists,
the action mask a uint8 list, log-probs float32 lists) and its lineage in the
Parquet key-value metadata (topic, partition, offsets, schema kind and
version, contract hash, writer, sha256 of the messages).

What it shows:
  1. pyarrow datasets: open a topic of the run and print its exact types and
     the lineage of one file.
  2. DuckDB: one query over every file of the run (rows per topic).
  3. DuckDB: join trajectories to their reward components and advantages and
     print success (reward_total > 0) by task and policy version.
  4. pyarrow.ipc.open_stream: read one Kafka message of the batches topic
     (an Arrow IPC stream, e.g. saved with
     `kcat -C -t <run>.batches -c 1 -e -D '' > batch.arrows`) given with --ipc.

With --check it exits 1 unless every type is the one trajflow declares, and
prints a JSON summary as its last line.
"""

import argparse
import glob
import json
import os
import sys

try:
    import duckdb
    import pyarrow as pa
    import pyarrow.dataset as ds
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq
except ImportError as e:
    sys.exit(f"analyze.py: {e}: run examples/analyst/setup.sh once, then .venv/bin/python examples/analyst/analyze.py DIR")


def find_run(root, run):
    """Returns DIR/run=<run> (the only run when run is None)."""
    if os.path.basename(os.path.normpath(root)).startswith("run="):
        return root
    if not any(d.startswith("run=") for d in os.listdir(root)) and os.path.isdir(os.path.join(root, "snapshots")):
        root = os.path.join(root, "snapshots")  # the --out of trajflow up
    if run:
        return os.path.join(root, f"run={run}")
    runs = sorted(d for d in os.listdir(root) if d.startswith("run="))
    if len(runs) != 1:
        sys.exit(f"{root}: expected one run=<run> directory, found {runs}; use --run")
    return os.path.join(root, runs[0])


def topic_glob(run_dir, topic="*"):
    return os.path.join(run_dir, f"topic={topic}", "partition=*", "*.parquet")


def has_topic(run_dir, topic):
    return bool(glob.glob(topic_glob(run_dir, topic)))


# The Arrow types trajflow declares (schemas/types.go); a reader that widened
# or renamed them would break bit-exact analysis.
EXPECTED = {
    "trajectories": {
        "turns.prompt_ids": pa.int32(),
        "turns.action_ids": pa.int32(),
        "turns.action_logprobs": pa.float32(),
        "turns.observation_ids": pa.int32(),
        "turns.policy_version": pa.int64(),
    },
    "batches": {
        "input_ids": pa.int32(),
        "position_ids": pa.int32(),
        "action_mask": pa.uint8(),
        "old_logprobs": pa.float32(),
        "advantages": pa.float32(),
        "policy_versions": pa.int32(),
        "segment_policy_versions": pa.int64(),
    },
}


def field_type(schema, path):
    """Type of a column, or of the values of a list column; 'a.b' looks into
    the struct elements of list column a."""
    head, _, rest = path.partition(".")
    t = schema.field(head).type
    if pa.types.is_list(t):
        t = t.value_type
    if rest:
        t = t.field(rest).type
        if pa.types.is_list(t):
            t = t.value_type
    return t


def check_types(run_dir):
    problems = []
    for topic, cols in EXPECTED.items():
        if not has_topic(run_dir, topic):
            continue
        schema = ds.dataset(os.path.join(run_dir, f"topic={topic}"), format="parquet", partitioning="hive").schema
        for path, want in cols.items():
            got = field_type(schema, path)
            if got != want:
                problems.append(f"{topic}.{path}: {got}, want {want}")
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot_dir")
    ap.add_argument("--run")
    ap.add_argument("--ipc", help="an Arrow IPC stream file (one Kafka message of a data-plane topic)")
    ap.add_argument("--check", action="store_true", help="exit 1 unless the types are exact; print a JSON summary")
    args = ap.parse_args()
    run_dir = find_run(args.snapshot_dir, args.run)
    summary = {"run_dir": run_dir}

    # 1. pyarrow datasets: one topic of the whole run.
    traj = ds.dataset(os.path.join(run_dir, "topic=trajectories"), format="parquet", partitioning="hive")
    print(f"trajectories: {traj.count_rows()} rows in {len(traj.files)} files")
    print("  turns:", traj.schema.field("turns").type)
    first = sorted(traj.files)[0]
    meta = pq.read_metadata(first).metadata
    lineage = {k.decode(): v.decode() for k, v in meta.items() if k.startswith(b"trajflow.") and k != b"trajflow.raw_messages"}
    print("  lineage of", os.path.relpath(first, run_dir), json.dumps(lineage, indent=2))
    pyarrow_rows = 0
    for f in glob.glob(topic_glob(run_dir)):
        pyarrow_rows += pq.read_metadata(f).num_rows

    # 2. DuckDB: one glob over the whole run.
    con = duckdb.connect()
    whole = con.sql(
        f"""SELECT topic, count(*) AS rows, count(DISTINCT (partition, _offset)) AS messages
            FROM read_parquet('{topic_glob(run_dir)}', hive_partitioning = true, union_by_name = true)
            GROUP BY topic ORDER BY topic"""
    ).fetchall()
    print("\nrows per topic over the whole run (DuckDB, one glob):")
    for topic, rows, msgs in whole:
        print(f"  {topic:14s} {rows:8d} rows {msgs:8d} messages")
    summary["duckdb_rows"] = sum(r[1] for r in whole)
    summary["pyarrow_rows"] = pyarrow_rows

    # 3. Join trajectories, reward components and advantages.
    if has_topic(run_dir, "rewarded") and has_topic(run_dir, "scored"):
        q = f"""
        WITH t AS (
            SELECT DISTINCT ON (record_id) record_id, task_id, turns[1].policy_version AS policy_version
            FROM read_parquet('{topic_glob(run_dir, "trajectories")}')),
        r AS (
            SELECT DISTINCT ON (record_id) record_id, reward_total, rewards
            FROM read_parquet('{topic_glob(run_dir, "rewarded")}')),
        s AS (
            SELECT DISTINCT ON (record_id) record_id, list_avg(turn_advantages) AS mean_advantage, "group".filtered AS filtered
            FROM read_parquet('{topic_glob(run_dir, "scored")}'))
        SELECT t.task_id, t.policy_version, count(*) AS attempts,
               avg(CASE WHEN r.reward_total > 0 THEN 1 ELSE 0 END) AS success,
               avg(r.reward_total) AS mean_reward, avg(s.mean_advantage) AS mean_advantage
        FROM t JOIN r USING (record_id) LEFT JOIN s USING (record_id)
        GROUP BY ALL ORDER BY t.policy_version, attempts DESC, t.task_id"""
        rows = con.sql(q).fetchall()
        print("\nsuccess by task and policy version (reward_total > 0):")
        print(f"  {'task':24s} {'version':>7s} {'n':>5s} {'success':>8s} {'reward':>9s} {'advantage':>10s}")
        for task, ver, n, succ, rew, adv in rows[:30]:
            adv = float("nan") if adv is None else adv
            print(f"  {task:24s} {ver:7d} {n:5d} {succ:8.3f} {rew:9.4f} {adv:10.4f}")
        if len(rows) > 30:
            print(f"  ... {len(rows) - 30} more")
        comps = con.sql(
            f"""SELECT c.name, c.version, count(*) AS n, avg(c.value) AS mean, count(*) FILTER (WHERE c.error <> '') AS unavailable
                FROM (SELECT unnest(rewards) AS c FROM read_parquet('{topic_glob(run_dir, "rewarded")}'))
                GROUP BY ALL ORDER BY c.name"""
        ).fetchall()
        print("\nreward components:")
        for name, ver, n, mean, unavailable in comps:
            print(f"  {name:20s} {ver:8s} n={n:<6d} mean={mean:.4f} unavailable={unavailable}")
        summary["task_versions"] = len(rows)
        summary["components"] = len(comps)

    # The task registry (public fields: id, version, split, the key the
    # prompt names), written once per run next to the topics.
    tasks_file = os.path.join(run_dir, "tasks.parquet")
    if os.path.exists(tasks_file):
        splits = con.sql(f"SELECT split, count(*) FROM read_parquet('{tasks_file}') GROUP BY split ORDER BY split").fetchall()
        print("\ntask registry:", ", ".join(f"{n} {s}" for s, n in splits))
        summary["tasks"] = sum(n for _, n in splits)

    # 4. A batches message as an Arrow IPC stream.
    if args.ipc:
        with open(args.ipc, "rb") as f:
            reader = ipc.open_stream(f)
            table = reader.read_all()
        md = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        print(f"\nIPC stream {args.ipc}: kind {md.get('trajflow.kind')} v{md.get('trajflow.version')}, {table.num_rows} rows")
        print("  input_ids:", table.schema.field("input_ids").type, " action_mask:", table.schema.field("action_mask").type)
        summary["ipc_rows"] = table.num_rows
        summary["ipc_action_mask"] = str(table.schema.field("action_mask").type.value_type)

    problems = check_types(run_dir)
    if args.ipc and summary.get("ipc_action_mask") != "uint8":
        problems.append(f"IPC action_mask values are {summary.get('ipc_action_mask')}, want uint8")
    summary["types_exact"] = not problems
    summary["problems"] = problems
    if problems:
        print("\ntype problems:", *problems, sep="\n  ")
    if args.check:
        print(json.dumps(summary))
        if problems or summary["duckdb_rows"] != summary["pyarrow_rows"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
