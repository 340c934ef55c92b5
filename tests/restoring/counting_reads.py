"""A real restore whose storage reads are counted where they are issued (``StoreReads.start``):
what ``check_restore``'s bytes and requests are compared against."""

from tpu_ckpt import settings, storage
from tpu_ckpt.catalog import open_checkpoint
from tpu_ckpt.restoring._exec import execute
from tpu_ckpt.restoring._plan import needed_slices, plan_restore
from tpu_ckpt.restoring._shared_reads import StoreReads


def restore_counting_reads(path, target):
    """The restore's own plan of ``target``, and the bytes and requests a real restore of it issues."""

    class Counting(StoreReads):
        nbytes = requests = 0

        def start(self, needed):
            reads = super().start(needed)
            Counting.requests += len(reads)
            Counting.nbytes += sum(p.length for r, _ in reads for _, p in r.pieces)
            return reads

    with open_checkpoint(storage.location(path)) as checkpoint:
        checkpoint.load(needed_slices(checkpoint.manifest, target, None, False))
        plan = plan_restore(checkpoint.manifest, target, batch_bytes=settings.settings().read_batch_bytes)
        execute(plan, Counting(checkpoint.store))
    return plan, (Counting.nbytes, Counting.requests)
