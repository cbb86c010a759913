#!/usr/bin/env python3
"""A trainq producer in plain Python with psycopg 3: the whole producer contract is SQL.

It submits GROUPS groups of chat rollouts for MODEL with a plain INSERT ... RETURNING id, one more
with the trainq.submit_group() wrapper, then shows how a bad group is refused (SQLSTATE TQ005,
the message names the trajectory and the field) without storing anything. It prints one JSON
object on stdout: {"ids": [...], "refused": {"sqlstate": ..., "message": ...}, "latest_checkpoint": ...}.

    DATABASE_URL=postgres://producer@127.0.0.1/trainq python examples/producer.py --model m1 --groups 3
"""

import argparse
import json
import os
import random

import psycopg
from psycopg.types.json import Jsonb


def rollout(question: str, answer: str, reward: float) -> dict:
    """One trajectory in chat form: OpenAI messages plus the scalar reward."""
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ],
        "reward": reward,
        "metrics": {"answer_chars": len(answer)},
    }


def sample_group(rng: random.Random, size: int) -> list:
    """The rollouts of one prompt: several answers, each with its own reward."""
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    answers = [str(a + b + rng.choice([0, 0, 1, -1])) for _ in range(size)]
    return [rollout(f"What is {a} + {b}?", ans, 1.0 if ans == str(a + b) else 0.0) for ans in answers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--policy-version", type=int, default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    out = {"ids": []}
    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        for _ in range(args.groups):
            row = conn.execute(
                "INSERT INTO trainq.groups (model, trajectories, policy_version, metadata) "
                "VALUES (%s, %s, %s, %s) RETURNING id",
                (args.model, Jsonb(sample_group(rng, args.group_size)), args.policy_version,
                 Jsonb({"producer": "examples/producer.py"})),
            ).fetchone()
            out["ids"].append(str(row[0]))
        row = conn.execute(
            "SELECT trainq.submit_group(%s, %s, policy_version => %s)",
            (args.model, Jsonb(sample_group(rng, args.group_size)), args.policy_version),
        ).fetchone()
        out["ids"].append(str(row[0]))
        bad = sample_group(rng, 2)
        bad[1]["reward"] = "NaN"  # JSON has no NaN; a string NaN is refused as not finite
        try:
            conn.execute("SELECT trainq.submit_group(%s, %s)", (args.model, Jsonb(bad)))
        except psycopg.Error as err:
            out["refused"] = {"sqlstate": err.sqlstate, "message": err.diag.message_primary}
        latest = conn.execute("SELECT step, uri FROM trainq.latest_checkpoint(%s)", (args.model,)).fetchone()
        out["latest_checkpoint"] = None if latest is None else {"step": latest[0], "uri": latest[1]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
