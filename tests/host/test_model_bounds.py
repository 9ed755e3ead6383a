"""Bad input is a failed check, never a crash or a read outside the model (docs/fault-matrix.md).

The three readers of a model directory (the preflight's model check, the read-ahead and its load order, the
checkpoint fingerprint) share one index parser and one boundary (host/pagecache.py `index_names`, `boundary`):
every shard resolves inside the model directory, or inside its Hugging Face repository for a cache snapshot,
and whatever the index holds ends in a failed check naming the file."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kimi_supervisor.checks import Verdict
from kimi_supervisor.host import pagecache
from kimi_supervisor.host.checkpoint import CheckpointError, fingerprint
from kimi_supervisor.host.readahead import ReadAhead
from kimi_supervisor.preflight.checks import check_model
from testkit.safetensors_files import write_model

INDEX = "model.safetensors.index.json"
SECRET = b"hunter2!" + b"the rest of a root-only file"


def secret_file(where: Path) -> tuple[Path, int]:
    """A root-only file outside the model, and its first 8 bytes read as a safetensors header length."""
    where.mkdir(parents=True, exist_ok=True)
    secret = where / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    return secret, struct.unpack("<Q", SECRET[:8])[0]


def test_a_shard_linked_to_a_file_outside_the_model_is_refused_unread(tmp_path: Path) -> None:
    # Before: the fingerprint followed the link, and its error quoted the secret's first 8 bytes as a length
    # (the engine's 0644 state file carried it); the read-ahead read the file and the load order listed it.
    shards = write_model(tmp_path / "m")
    secret, prefix = secret_file(tmp_path / "elsewhere")
    shards[0].unlink()
    shards[0].symlink_to(secret)
    with pytest.raises(CheckpointError) as err:
        fingerprint(tmp_path / "m")
    assert str(err.value) == f"{shards[0]}: resolves to {secret}, outside the model ({tmp_path / 'm'})"
    assert str(prefix) not in str(err.value)
    check = check_model(str(tmp_path / "m"))
    assert (check.verdict, check.message) == (
        Verdict.FAIL,
        f"1 of 3 shards named in {tmp_path / 'm' / INDEX} resolve outside the model ({tmp_path / 'm'}): "
        f"{shards[0].name}",
    )
    assert secret not in [Path(os.path.realpath(p)) for p in pagecache.shards_in_load_order(tmp_path / "m")]
    assert pagecache.shards_in_load_order(tmp_path / "m") == shards[1:]
    ahead = ReadAhead.for_model(tmp_path / "m", 2)
    assert ahead is not None and [p for p, _ in ahead._shards] == shards[1:]


def test_an_index_that_names_a_path_out_of_the_model_or_links_out_is_refused(tmp_path: Path) -> None:
    shards = write_model(tmp_path / "m")
    secret, _ = secret_file(tmp_path / "elsewhere")
    index = tmp_path / "m" / INDEX
    index.write_text(json.dumps({"weight_map": {"a": shards[0].name, "b": "../elsewhere/secret"}}))
    check = check_model(str(tmp_path / "m"))
    assert check.verdict is Verdict.FAIL and "resolve outside the model" in check.message
    assert "../elsewhere/secret" in check.message
    assert pagecache.shards_in_load_order(tmp_path / "m") == [shards[0]]
    with pytest.raises(CheckpointError, match="names shards that are missing"):
        fingerprint(tmp_path / "m")
    # The index itself a link out of the model: refused before it is opened.
    index.unlink()
    index.symlink_to(secret)
    check = check_model(str(tmp_path / "m"))
    assert check.message == (
        f"{index}: unreadable shard index (resolves to {secret}, outside the model ({tmp_path / 'm'}))"
    )
    with pytest.raises(CheckpointError, match="outside the model"):
        fingerprint(tmp_path / "m")


def test_a_hugging_face_snapshot_reads_its_own_blobs_and_no_other_repositorys(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    repo = hub / "models--moonshotai--Kimi-K2.5"
    other = hub / "models--someone--else"
    flat = write_model(tmp_path / "flat")
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (other / "blobs").mkdir(parents=True)
    for i, path in enumerate([*flat, flat[0].parent / INDEX]):
        blob = f"blob{i}"
        (repo / "blobs" / blob).write_bytes(path.read_bytes())
        (snapshot / path.name).symlink_to(f"../../blobs/{blob}")
    want = fingerprint(tmp_path / "flat")
    assert want is not None and fingerprint(snapshot) == want
    assert check_model(str(snapshot)).verdict is Verdict.OK
    assert pagecache.shards_in_load_order(snapshot) == [snapshot / p.name for p in flat]
    # A link into another repository of the same cache is outside this model.
    (other / "blobs" / "x").write_bytes(flat[1].read_bytes())
    (snapshot / flat[1].name).unlink()
    (snapshot / flat[1].name).symlink_to(other / "blobs" / "x")
    with pytest.raises(CheckpointError, match=f"resolves to {other / 'blobs' / 'x'}, outside the model \\({repo}\\)"):
        fingerprint(snapshot)
    assert check_model(str(snapshot)).verdict is Verdict.FAIL


DEEP = "[" * 100_000 + "]" * 100_000

BAD_INDEXES: list[tuple[bytes, str]] = [
    (json.dumps({"weight_map": {"a": 1, "b": 2}}).encode(), "weight_map['a'] is a JSON number, expected a shard file"),
    (json.dumps({"weight_map": {"a": "x.safetensors", "b": 3}}).encode(), "weight_map['b'] is a JSON number"),
    (json.dumps({"weight_map": {"a": None}}).encode(), "weight_map['a'] is a JSON null"),
    (json.dumps({"weight_map": {"a": ["x"]}}).encode(), "weight_map['a'] is a JSON array"),
    (json.dumps({"weight_map": {"a": ""}}).encode(), "weight_map['a'] is '', expected a shard file name"),
    (json.dumps({"weight_map": {"a": "x\u0000.safetensors"}}).encode(), "weight_map['a'] is 'x\\x00.safetensors'"),
    (json.dumps({"weight_map": ["x.safetensors"]}).encode(), "not a shard index (weight_map is a JSON array)"),
    (json.dumps({"weight_map": "x.safetensors"}).encode(), "not a shard index (weight_map is a JSON string)"),
    (json.dumps({"metadata": {}}).encode(), "not a shard index (no weight_map)"),
    (b"[]", "not a shard index (a JSON array, expected an object)"),
    (b"3", "not a shard index (a JSON number, expected an object)"),
    (b'{"weight_map": ' + DEEP.encode() + b"}", "not a shard index (JSON nested too deep)"),
    (DEEP.encode(), "not a shard index (JSON nested too deep)"),
    (b'{"weight_map": {"a": ' + b"1" * 5000 + b"}}", "ValueError: Exceeds the limit"),
    (b'{"weight_map": "\xc3\x28"}', "UnicodeDecodeError"),
    (b"{not json", "JSONDecodeError: Expecting property name"),
]


def assert_a_named_failure(model: Path, what: str | None = None) -> None:
    """Each reader of the model: a failed check or CheckpointError naming the index, the read-ahead's order
    falls back to the *.safetensors (vLLM would fail on the index itself), and nothing else is raised."""
    index = model / INDEX
    check = check_model(str(model))
    assert check.verdict is Verdict.FAIL
    assert check.message.startswith(f"{index}: unreadable shard index ("), check.message
    assert "\n" not in check.message and len(check.message) < 600
    if what is not None:
        assert what in check.message
    with pytest.raises(CheckpointError) as err:
        fingerprint(model)
    assert str(err.value).startswith(f"{index}: ") and "\n" not in str(err.value)
    assert pagecache.shards_in_load_order(model) == sorted(model.glob("*.safetensors"))
    ReadAhead.for_model(model, 2)


@pytest.mark.parametrize(("raw", "what"), BAD_INDEXES, ids=range(len(BAD_INDEXES)))
def test_every_bad_index_is_a_failed_check_naming_it(tmp_path: Path, raw: bytes, what: str) -> None:
    # Before: numbers for names, a deep nesting (RecursionError), a NUL in a name crashed the preflight, the
    # read-ahead and the fingerprint with exit 70.
    write_model(tmp_path / "m")
    (tmp_path / "m" / INDEX).write_bytes(raw)
    assert_a_named_failure(tmp_path / "m", what)


def test_an_index_larger_than_any_real_one_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    write_model(tmp_path / "m")
    with open(tmp_path / "m" / INDEX, "wb") as f:
        f.truncate(pagecache.MAX_INDEX_BYTES + 1)  # sparse: no disk, and no real index is a tenth of it
    assert_a_named_failure(tmp_path / "m", "larger than 64 MiB: not a shard index")


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    doc=st.one_of(
        JSON,
        st.fixed_dictionaries({"weight_map": JSON}),
        st.fixed_dictionaries({"weight_map": st.dictionaries(st.text(max_size=8), JSON, max_size=4)}),
    ),
    raw=st.one_of(st.none(), st.binary(max_size=64)),
)
def test_whatever_the_index_holds_no_reader_raises_anything_else(doc: object, raw: bytes | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp)
        shards = write_model(model, shards=2)
        (model / INDEX).write_bytes(json.dumps(doc).encode() if raw is None else raw)
        try:
            names = pagecache.index_names(model)
        except pagecache.ModelFileError as exc:
            assert exc.path == str(model / INDEX) and "\n" not in exc.what
            assert_a_named_failure(model)
            return
        # A well-formed index: every reader answers, each in its own words, and none reads outside the model.
        assert names is not None and all(isinstance(n, str) for n in names)
        assert check_model(str(model)).verdict in (Verdict.OK, Verdict.FAIL)
        try:
            fingerprint(model)
        except CheckpointError as exc:
            assert "\n" not in str(exc)
        assert all(pagecache.inside(p, model.resolve()) for p in pagecache.shards_in_load_order(model))
        ReadAhead.for_model(model, 2)
        assert shards[0].exists()
