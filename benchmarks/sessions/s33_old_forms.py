"""Session 33's embedding and step-metadata changes undone in the process (the `old` arm of
gpu_s34a.sh / gpu_s34b.sh, with the router's logits in a launch of their own beside it): the
embedding as a gather + a copy, the token mask and the expert counts' zeroing as launches of
their own beside the step metadata. Run by ``exec`` in ``forward_with``'s process."""

import rackserve.ops.triton.embed as em
from rackserve.ops import reference
from rackserve.runner import cuda_graph as cg

em.embed_streams = reference.embed_streams
new_metadata = cg._StepGraphs.metadata


def old_metadata(self, b, bucket):
    rows = self.inputs(b)[2]
    _ = rows != self.buffers.null_row  # the token mask: a launch of its own
    meta = new_metadata(self, b, bucket)
    self.expert_counts.zero_()  # and the zeroing: another
    return meta


cg._StepGraphs.metadata = old_metadata
