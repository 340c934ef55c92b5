"""Every manifest field the command line shows is decoded and checked first: a resealed
manifest with a malformed leaf sharding is a typed error naming the field, in the library
and in ``tpu-ckpt inspect``, never a traceback (issues #26, #29)."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tpu_ckpt as tc
from tests.support.helpers import manifest, write_manifest
from tpu_ckpt import cli


@pytest.fixture
def ckpt(tmp_path):
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    tc.save(tmp_path / "c", {"sh": jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P("x")))})
    return tmp_path / "c"


def _sharding(doc) -> dict:
    return next(leaf for leaf in doc["leaves"] if leaf["key"] == "sh")["sharding"]


SHARDINGS = {
    "mesh_list": (lambda s: s.update(mesh=[["x", 2]]), "mesh"),
    "no_mesh": (lambda s: s.pop("mesh"), "mesh"),
    "mesh_size_string": (lambda s: s.update(mesh={"x": "2"}), "mesh"),
    "spec_int": (lambda s: s.update(spec=7), "spec"),
    "spec_entry_int": (lambda s: s.update(spec=[3]), "spec"),
    "spec_inner_null": (lambda s: s.update(spec=[["x", None]]), "spec"),
    "type_int": (lambda s: s.update(type=3), "sharding"),
    "num_devices_string": (lambda s: s.update(type="GSPMDSharding", num_devices="8"), "num_devices"),
}


@pytest.mark.parametrize("name", SHARDINGS)
def test_a_malformed_sharding_is_a_typed_error_in_the_library_and_the_cli(ckpt, name, capsys):
    edit, field = SHARDINGS[name]
    doc = manifest(ckpt)
    edit(_sharding(doc))
    write_manifest(ckpt, doc)
    with pytest.raises(tc.CorruptCheckpointError, match=f"field leaves\\[0\\].*{field}"):
        tc.metadata(ckpt)
    for command in (["inspect"], ["inspect", "--json"], ["verify"]):
        assert cli.main([*command, str(ckpt)]) != 0, command
        out = capsys.readouterr()
        assert "manifest.json" in out.out + out.err and "Traceback" not in out.err, command


def test_the_shardings_a_save_writes_still_decode(ckpt, capsys):
    assert cli.main(["inspect", str(ckpt)]) == 0
    assert "x=2 P(x)" in capsys.readouterr().out
