"""The index location has one owner: puma/index/layout.py names every path under ``index.uri`` (the
alias, version folders, rejects files) and in an index folder (manifest, trained index, shard files)."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pyarrow as pa

from puma import storage
from puma.config import IndexConfig
from puma.index import build_index, read_manifest
from puma.index.layout import IndexFolder, IndexLocation, removed_file, shard_file
from puma.index.versions import alias_uri, version_uri

REPO = Path(__file__).resolve().parent.parent
LAYOUT = {"alias.json", "manifest.json", "trained.faiss", "index.faiss", "embeddings.parquet", "removed-",
          "evaluation.json"}  # as literals
JOINED = {"versions", "shards", "rejects"}  # common words: as path parts (a join argument) or constants


def test_a_location_names_its_alias_versions_and_rejects():
    location = IndexLocation("s3://bucket/index/shop")
    assert location.alias == "s3://bucket/index/shop/alias.json" == alias_uri(location.uri)
    assert location.version("m-0123") == "s3://bucket/index/shop/versions/m-0123" == version_uri(location.uri,
                                                                                                 "m-0123")
    assert location.index("m-0123") == location.version("m-0123") and location.index("") == location.uri
    assert location.rejects("shoes") == "s3://bucket/index/shop/rejects/shoes.jsonl"


def test_an_index_folder_names_the_files_its_manifest_lists(tmp_path):
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((30, 8)).astype(np.float32)
    table = pa.table({"item_id": [f"i{n}" for n in range(30)], "dataset": ["d"] * 30, "label": [0] * 30,
                      "embedding": pa.FixedSizeListArray.from_arrays(pa.array(vectors.ravel()), 8)})
    folder = IndexFolder(str(tmp_path / "index"))
    build_index(folder.uri, table, IndexConfig(index_type="flat", shard_size=20))
    manifest = read_manifest(folder.uri)
    assert storage.exists(folder.manifest) and storage.exists(folder.trained)
    shards = manifest.shards
    assert [s.index.path for s in shards] == [shard_file(s.name, "index.faiss") for s in shards]
    assert all(storage.exists(folder.file(e.path)) for s in manifest.shards for e in (s.index, s.embeddings))
    assert folder.shard_folders() == [folder.shard(s.name) for s in manifest.shards]
    assert shard_file("shard-00001", removed_file("ab" * 32)) == f"shards/shard-00001/removed-{'ab' * 8}.npy"
    assert folder.evaluation == f"{folder.uri}/evaluation.json"


def _layout_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    joined = {a.value for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and n.func.attr == "join" for a in n.args if isinstance(a, ast.Constant)}
    assigned = {n.value.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and isinstance(n.value, ast.Constant)}
    return (LAYOUT & literals) | (JOINED & (joined | assigned))


def test_no_other_index_module_names_the_layout():
    """The layout's names as string literals only in puma/index/layout.py, and a manifest's file paths
    turned into URIs only there (IndexFolder.file)."""
    owners = {}
    for path in sorted((REPO / "puma" / "index").rglob("*.py")):
        if path.name == "layout.py":
            continue
        for name in _layout_names(path):
            owners.setdefault(name, []).append(str(path.relative_to(REPO)))
        if '.path.split("/")' in path.read_text():
            owners.setdefault('.path.split("/")', []).append(str(path.relative_to(REPO)))
    assert owners == {}, owners
