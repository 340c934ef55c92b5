"""A restore plans each leaf from this process's devices alone (#37 item 7): the blocks of a
NamedSharding worked out from the devices' places in the mesh equal JAX's map."""

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support import process_group
from tpu_ckpt.sharding import index_to_slice, local_indices
from tpu_ckpt.sharding._local_indices import _spec_axes, block_indices

_MESHES = [((8,), ("a",)), ((2, 4), ("a", "b")), ((2, 2, 2), ("a", "b", "c")), ((4, 2), ("b", "a"))]


def _specs(names):
    entries = [None, *names, *itertools.permutations(names, 2)]
    return [P(x, y) for x, y in itertools.product(entries, repeat=2) if not (set(_flat(x)) & set(_flat(y)))]


def _flat(entry):
    return () if entry is None else (entry,) if isinstance(entry, str) else entry


@pytest.mark.parametrize(("mesh_shape", "names"), _MESHES)
def test_the_blocks_of_some_devices_equal_jaxs_map(mesh_shape, names):
    devices = np.array(jax.devices()[:8]).reshape(mesh_shape)
    mesh = Mesh(devices, names)
    some = {d: tuple(int(i) for i in place) for place, d in np.ndenumerate(devices) if d.id % 3 != 1}  # "this host's"
    shape = (16, 24)
    for spec in _specs(names):
        sharding = NamedSharding(mesh, spec)
        expected = sharding.devices_indices_map(shape)
        ours = block_indices(mesh, _spec_axes(sharding, shape), shape, some)
        assert set(ours) == set(some)
        for device, index in ours.items():
            assert index_to_slice(index, shape) == index_to_slice(expected[device], shape), (spec, device)
        assert {d: index_to_slice(i, shape) for d, i in local_indices(sharding, shape).items()} == {
            d: index_to_slice(i, shape) for d, i in sharding.addressable_devices_indices_map(shape).items()}


def test_a_sharding_it_does_not_read_goes_through_jax():
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    uneven = NamedSharding(mesh, P("b"))
    assert _spec_axes(uneven, (6,)) is None  # 4 does not divide 6: JAX's map (or its error)
    assert _spec_axes(NamedSharding(mesh, P(P.UNCONSTRAINED)), (8,)) is None
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert local_indices(single, (3,)) == single.addressable_devices_indices_map((3,))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_plain_restore_plans_each_leaf_from_this_processs_devices_only(tmp_path):
    results = process_group.run("sharding.local_indices_scenarios.plain_restore_index_entries", 2, str(tmp_path))
    for r in results:
        assert r.returncode == 0 and r.result is not None, r.output[-4000:]
        res = r.result
        print(res)
        assert res["mismatches"] == [], res
        assert res["local_entries"] == 6 * 4, res  # 6 layouts x this process's 4 devices
        assert res["global_entries"] == 0, res  # never the job's 8 devices per layout
