"""Rank 0's second copy of the word embedding in a V checkpoint: a replica that is never saved.

megatron keeps one copy of the word embedding per stage that uses it and checkpoints them as
one tensor, ``embedding.word_embeddings.weight``: the first stage's copy is the main replica
(replica_id (0, 0, dp)), the last or MTP stage's is marked a copy of it, (1, 0, dp), loaded and
never saved (``tie_embeddings_and_output_weights_state_dict``, language_module.py:349 in
megatron-core 0.16, :503 in 0.19; ``tie_word_embeddings_state_dict``,
multi_token_prediction.py:75, :85). The optimizer state of that copy inherits its replica id
(``dataclasses.replace`` of the model's entry: dist_checkpointing/optimizer.py:98 for megatron's
plain optimizer, distrib_optimizer.py:1532, 0.19 :1821, for the distributed optimizer's fully
reshardable format; the dp_reshardable format keys its state by gradient bucket instead)::

    1F1B, DP 2   rank 0, stage 0: emb (0,0,dp), main    last rank: copy (1,0,dp), not main
                 in different data-parallel groups
    V, DP 2      rank 0, chunk 0 (stage 0): emb main, chunk 1 (stage 2p-1): copy, not main
                 in one data-parallel group

megatron's fully parallel save (``--ckpt-fully-parallel-save``, on by default) re-assigns the
main replicas inside each data-parallel group: every local ShardedTensor of a shard that some
rank of the group holds as main becomes main (replica_id 0) on the one rank chosen to write it,
all others 1 (``distribute_main_replicas_with_precomputed_distribution``,
strategies/fully_parallel.py:460, 0.19 :469). Under 1F1B no rank of the copy's group holds
the shard as main, so the copy stays one. Under the V the chosen rank would write the shard
twice, and dist_checkpointing refuses the save ("Invalid access pattern for
ShardedTensor(key='embedding.word_embeddings.weight' ...").

Chunk 1 therefore gives its copy's entry as a :class:`ShardedTensorFactory`
(:func:`replica_entries`, installed by model.save_copy_as_replica) that megatron's optimizers
carry over to the copy's state entries, as they do for any factory (by the same
``dataclasses.replace``)::

    build (save and load)   a :class:`NonMainReplica`: the ShardedTensor megatron made, which
                            stays non-main when the fully parallel save makes it main, so the
                            shard is written once, from chunk 0's entry; the checkpoint is the
                            one 1F1B writes
    merge (after a load)    the loaded tensor, copied: megatron's fully parallel load
                            (``--ckpt-fully-parallel-load``) hands every local entry of one
                            shard the same tensor object (``_fill_in_deferred_sharded_items``,
                            fully_parallel.py:502, 0.19 :511), and torch's optimizers keep
                            the tensors they load, so megatron's plain optimizer would update one
                            Adam state for both copies, twice per step

Leaving the copy out of the sharded state dict instead (and copying chunk 0's weight into it
after a load) fails the optimizers: both look every parameter they hold up in the model's
sharded state dict ("Param id ... does not match any model sharded param", "Model param ...
not in model_sharded_state_dict"), and the copy's optimizer state would still need a value;
under the distributed optimizer the embedding and its copy sit in different gradient buckets,
sharded differently over the data-parallel ranks.
"""
from __future__ import annotations

import dataclasses
import functools

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_outplace
from megatron.core.dist_checkpointing.mapping import (ShardedTensor, ShardedTensorFactory,
                                                      is_main_replica)

__all__ = ["NonMainReplica", "replica_entries"]


class NonMainReplica(ShardedTensor):
    """A ShardedTensor that stays a non-main replica whatever replica_id it is given: setting
    a main one (0, or all zeros, as the fully parallel save does on the rank it picks to write
    a shard) keeps the previous one (1 if there is none)."""

    @property
    def replica_id(self):
        return self.__dict__["_replica_id"]

    @replica_id.setter
    def replica_id(self, value):
        if is_main_replica(value):
            value = self.__dict__.get("_replica_id", 1)
        self.__dict__["_replica_id"] = value


def replica_entries(sharded_state_dict, tensor):
    """``sharded_state_dict`` (out of place) with each non-main ShardedTensor whose data is
    ``tensor`` a factory of a :class:`NonMainReplica` whose loaded tensor is a copy (module
    doc); everything else as it is."""

    def mark(value):
        if type(value) is ShardedTensor and value.data is tensor and \
                not is_main_replica(value.replica_id):
            return ShardedTensorFactory(value.key, value.data,
                                        functools.partial(_non_main_replica, value),
                                        _own_tensor, value.replica_id, value.flattened_range)
        return value

    return dict_list_map_outplace(mark, sharded_state_dict)


def _non_main_replica(made, key, data, replica_id, flattened_range) -> NonMainReplica:
    """The factory's build: ``made`` (megatron's entry for the copy) as a NonMainReplica with
    the factory's key and data (the copy's, or its optimizer state's: same shape)."""
    fields = {field.name: getattr(made, field.name)
              for field in dataclasses.fields(made) if field.init}
    fields.update(key=key, data=data, replica_id=replica_id, flattened_range=flattened_range,
                  dtype=made.dtype if data is None else data.dtype)
    return NonMainReplica(**fields)


def _own_tensor(loaded):
    """The factory's merge: a tensor no other entry was given."""
    return loaded.clone()
