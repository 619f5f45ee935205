"""Removals, compaction, versions and their crash safety at the index layer (no Ray, no model).

The kill tests run the write in a child process that ends itself with status 137 at a named fault
point (puma.faults: no ``finally``, no cleanup, as a SIGKILL), check that what is left is the old
state, complete (verify passes, search returns exactly the old live items), then re-run the write
and check it converges to the new state; three rounds each, each round starting from the last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from puma.config import IndexConfig
from puma.index import ShardedIndex, build_index, read_manifest, verify
from puma.index.build import commit_changes, compact, live_table
from puma.index.manifest import IndexIntegrityError
from puma.index.plan import IndexInputError
from puma.index.versions import (
    list_versions,
    promote,
    read_alias,
    resolve,
    rollback,
    version_uri,
)

REPO = Path(__file__).resolve().parent.parent
DIM = 16


def vectors(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def items(names: list[str], seed: int) -> tuple[pa.Table, np.ndarray]:
    x = vectors(len(names), seed)
    embedding = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), DIM)
    table = pa.table({"item_id": names, "embedding": embedding, "catalogue": ["c"] * len(names)})
    return table, x


def live_ids(uri: str) -> set[str]:
    """The item ids search can return, found by searching every stored vector with k = all."""
    index = ShardedIndex.open(uri, use_gpu=False, nprobe=64)
    table = live_table(uri)
    x = np.stack(table["embedding"].to_numpy(zero_copy_only=False)).astype(np.float32)
    _, found = index.search(x, index.live_total)
    return {str(i) for i in found.ravel() if i}


def global_ids(uri: str, names: list[str]) -> np.ndarray:
    """The FAISS global ids of live items (rows mapped back through the shards)."""
    table = live_table(uri)
    manifest = read_manifest(uri)
    ids = []
    for shard in manifest.shards:  # live rows with their global ids
        import pyarrow.parquet as pq

        stored = pq.read_table(Path(uri) / shard.embeddings.path, columns=["index_id", "item_id"])
        ids += [(r["item_id"], r["index_id"]) for r in stored.to_pylist()]
    live = set(table["item_id"].to_pylist())
    by_name = {name: gid for name, gid in ids if name in live}
    return np.array([by_name[n] for n in names], dtype=np.int64)


@pytest.mark.parametrize("kind", ["flat", "ivf_flat"])
def test_removed_items_are_never_returned_and_compaction_drops_them(tmp_path: Path, kind: str) -> None:
    uri = str(tmp_path / "index")
    names = [f"c/{i:03d}" for i in range(120)]
    table, x = items(names, seed=1)
    cfg = IndexConfig(index_type=kind, nlist=4 if kind != "flat" else 0, shard_size=40, use_gpu=False)
    build_index(uri, table, cfg)
    served = ShardedIndex.open(uri, use_gpu=False, nprobe=4)
    gone = names[:12] + names[50:53]  # 12 of shard 0 (30 %), 3 of shard 1 (7.5 %)
    done = commit_changes(uri, remove=global_ids(uri, gone))
    assert (done.removed, done.total, read_manifest(uri).removed) == (15, 105, 15)
    fresh = served.refreshed()
    assert fresh.reused_shards(served) == 1  # shard 2 untouched; shards 0 and 1 reloaded
    scores, found = fresh.search(x, 105)
    assert not set(gone) & set(found.ravel()) and fresh.live_total == 105
    with pytest.raises(IndexInputError, match="not in index"):
        fresh.lookup([gone[0]])
    assert live_ids(uri) == set(names) - set(gone) and verify(uri).ok
    # compaction: shard 0 passes 20 % removed, shard 1 does not
    compacted = compact(uri, 0.2)
    manifest = read_manifest(uri)
    assert compacted.dropped == ["shard-00000"] and [s.name for s in manifest.shards] == [
        "shard-00001", "shard-00002", "shard-00003"]
    assert [s.id_start for s in manifest.shards] == [40, 80, 120] and manifest.stored == 108
    assert manifest.shards[-1].count == 28 and manifest.total == 105 and verify(uri).ok
    again = ShardedIndex.open(uri, use_gpu=False, nprobe=4)
    keep = [i for i, n in enumerate(names) if n not in gone]
    s1, f1 = again.search(x[keep], 5)
    exact = x[keep] @ x[keep].T  # what one exact index over the live vectors answers
    order = np.argsort(-exact, axis=1, kind="stable")[:, :5]
    if kind == "flat":
        assert (f1 == np.array(names)[keep][order]).all()
    assert (f1[:, 0] == np.array(names)[keep]).all()  # every live item finds itself first
    assert live_ids(uri) == set(names) - set(gone)
    # ids are never reused: a new item after compaction starts past every id given out
    commit_changes(uri, items(["c/new"], seed=7)[0])
    assert read_manifest(uri).shards[-1].id_start == 148 and verify(uri).ok


def test_a_changed_item_is_replaced_in_one_commit_and_orphans_go_at_the_next_write(tmp_path: Path) -> None:
    uri = str(tmp_path / "index")
    names = [f"c/{i:02d}" for i in range(30)]
    build_index(uri, items(names, seed=1)[0], IndexConfig(index_type="flat", shard_size=10, use_gpu=False))
    new, xn = items(["c/05", "c/25"], seed=9)  # the same ids, new embeddings
    commit_changes(uri, new, remove=global_ids(uri, ["c/05", "c/25"]))
    index = ShardedIndex.open(uri, use_gpu=False)
    _, found = index.search(xn, 1)
    assert list(found[:, 0]) == ["c/05", "c/25"] and index.live_total == 30 and verify(uri).ok
    np.testing.assert_allclose(index.embeddings(["c/05"]), xn[:1])  # the stored vector is the new one
    stale = Path(uri) / "shards" / "shard-00000"
    before = {p.name for p in stale.iterdir()}
    commit_changes(uri, remove=global_ids(uri, ["c/01"]))  # a second removal supersedes the tombstone
    after = {p.name for p in stale.iterdir()}
    assert len([n for n in after if n.startswith("removed-")]) == 2  # the old one is left ...
    commit_changes(uri, items(["c/99"], seed=3)[0])  # ... until the next write cleans it
    assert len([p for p in stale.iterdir() if p.name.startswith("removed-")]) == 1 and before <= after


# ----------------------------------------------------------------------------- kill tests

WRITER = textwrap.dedent("""
    import json, sys
    import numpy as np, pyarrow as pa
    from puma.index.build import commit_changes, compact
    from puma.index.versions import promote
    op, uri, arg = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if op == "commit":
        x = np.asarray(arg["x"], dtype=np.float32)
        table = pa.table({"item_id": arg["add"], "catalogue": ["c"] * len(arg["add"]),
                          "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), x.shape[1])})
        commit_changes(uri, table, remove=np.asarray(arg["remove"], dtype=np.int64), shard_size=4)
    elif op == "compact":
        compact(uri, arg["fraction"])
    elif op == "promote":
        promote(uri, arg["version"], keep=arg["keep"])
""")


def run_writer(tmp_path: Path, op: str, uri: str, arg: dict, fault: str = "") -> int:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PUMA_FAULT_AT", None)
    if fault:
        env["PUMA_FAULT_AT"] = fault
    proc = subprocess.run([sys.executable, str(script), op, uri, json.dumps(arg)], env=env,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode


def test_kill_mid_commit_leaves_the_old_state_and_the_rerun_converges(tmp_path: Path) -> None:
    uri = str(tmp_path / "index")
    names = [f"c/{i:02d}" for i in range(20)]
    build_index(uri, items(names, seed=1)[0], IndexConfig(index_type="flat", shard_size=8, use_gpu=False))
    expected = set(names)
    for round_, fault in enumerate(["index.shard_written", "index.commit", "index.shard_written:2"]):
        add = [f"c/r{round_}-{i}" for i in range(6)]  # two new shards of 4 and 2
        remove = sorted(expected)[:3]
        arg = {"add": add, "x": vectors(6, 10 + round_).tolist(), "remove": global_ids(uri, remove).tolist()}
        assert run_writer(tmp_path, "commit", uri, arg, fault) == 137
        assert verify(uri).ok and live_ids(uri) == expected, f"round {round_}: not the old state"
        assert verify(uri).orphans  # the killed write's files are there, uncommitted
        assert run_writer(tmp_path, "commit", uri, arg) == 0
        expected = (expected - set(remove)) | set(add)
        report = verify(uri)
        assert report.ok and not report.orphans and live_ids(uri) == expected, f"round {round_}"


def test_kill_mid_compaction_leaves_the_old_state_and_the_rerun_converges(tmp_path: Path) -> None:
    uri = str(tmp_path / "index")
    names = [f"c/{i:02d}" for i in range(40)]
    build_index(uri, items(names, seed=2)[0], IndexConfig(index_type="ivf_flat", nlist=2, shard_size=10,
                                                          use_gpu=False))
    expected = set(names)
    for round_, fault in enumerate(["index.shard_written", "index.commit", "index.commit"]):
        shard = read_manifest(uri).shards[0]
        victims = _live_names_of(uri, shard.name)[:5]  # half the first shard: over the 0.3 threshold
        commit_changes(uri, remove=global_ids(uri, victims))
        expected -= set(victims)
        before = [s.name for s in read_manifest(uri).shards]
        assert run_writer(tmp_path, "compact", uri, {"fraction": 0.3}, fault) == 137
        assert [s.name for s in read_manifest(uri).shards] == before, f"round {round_}: manifest changed"
        assert verify(uri).ok and live_ids(uri) == expected
        assert run_writer(tmp_path, "compact", uri, {"fraction": 0.3}) == 0
        manifest = read_manifest(uri)
        assert shard.name not in [s.name for s in manifest.shards] and manifest.removed == 0
        assert verify(uri).ok and live_ids(uri) == expected and manifest.total == len(expected)


def _live_names_of(uri: str, shard_name: str) -> list[str]:
    import pyarrow.parquet as pq

    manifest = read_manifest(uri)
    shard = next(s for s in manifest.shards if s.name == shard_name)
    names = pq.read_table(Path(uri) / shard.embeddings.path, columns=["item_id"])["item_id"].to_pylist()
    live = set(live_table(uri)["item_id"].to_pylist())
    return [n for n in names if n in live]


def test_kill_mid_promotion_keeps_the_old_alias_and_the_rerun_converges(tmp_path: Path) -> None:
    location = str(tmp_path / "loc")
    names = [f"c/{i:02d}" for i in range(12)]
    cfg = IndexConfig(index_type="flat", shard_size=8, use_gpu=False)
    made = []
    for n in range(4):  # four versions: v0 live, then three promotions, each killed once first
        version = f"m-{n:016x}"
        table = items(names, seed=20 + n)[0]
        build_index(version_uri(location, version), table, cfg, model_id=f"sha256:{n:016x}")
        _record_catalogue(version_uri(location, version))
        made.append(version)
        if n == 0:
            promote(location, version)
            continue
        fault = ["versions.promote", "versions.retain", "versions.promote"][n - 1]
        old = read_alias(location)
        code = run_writer(tmp_path, "promote", location, {"version": version, "keep": 2}, fault)
        alias = read_alias(location)
        if fault == "versions.promote":  # killed before the alias write: the old alias, whole
            assert code == 137 and alias == old and resolve(location) == version_uri(location, old.live)
        else:  # killed while deleting a version beyond retention: the new alias, whole
            assert code == 137 and alias.live == version and alias.previous == old.live
        assert verify(resolve(location)).ok and live_ids(resolve(location)) == set(names)
        assert run_writer(tmp_path, "promote", location, {"version": version, "keep": 2}) == 0
        alias = read_alias(location)
        assert alias.live == version and verify(resolve(location)).ok
        kept = [v.name for v in list_versions(location)]
        assert kept[-2:] == made[-2:] and len(kept) <= 3  # live + previous (+ one not yet retained)
        folders = sorted(p.name for p in (Path(location) / "versions").iterdir())
        assert set(folders) == set(kept)  # no half-deleted version is left behind
    assert rollback(location).live == made[-2] and resolve(location) == version_uri(location, made[-2])


def _record_catalogue(uri: str) -> None:
    commit_changes(uri, update=lambda m: m.catalogues.update({"c": {"items": 12}}))


def test_promote_refuses_a_version_lacking_a_live_catalogue_or_failing_verify(tmp_path: Path) -> None:
    location = str(tmp_path / "loc")
    cfg = IndexConfig(index_type="flat", use_gpu=False)
    a, b = version_uri(location, "m-a"), version_uri(location, "m-b")
    build_index(a, items(["c/1", "c/2"], seed=1)[0], cfg, model_id="sha256:a")
    commit_changes(a, update=lambda m: m.catalogues.update({"s3://x/shop.csv": {}, "s3://x/dogs": {}}))
    promote(location, "m-a")
    build_index(b, items(["c/1"], seed=2)[0], cfg, model_id="sha256:b")
    commit_changes(b, update=lambda m: m.catalogues.update({"s3://x/shop.csv": {}}))
    with pytest.raises(IndexInputError, match=r"lacks 1 catalogue\(s\) of the live version, e.g. \['s3://x/dogs'\]"):
        promote(location, "m-b")
    commit_changes(b, update=lambda m: m.catalogues.update({"s3://x/dogs": {}}))
    shard = Path(b) / read_manifest(b).shards[0].index.path
    shard.write_bytes(shard.read_bytes()[:-4])  # damaged
    with pytest.raises(IndexIntegrityError, match="failed verification"):
        promote(location, "m-b")
    assert read_alias(location).live == "m-a"
    with pytest.raises(IndexInputError, match="no previous version"):
        rollback(location)
