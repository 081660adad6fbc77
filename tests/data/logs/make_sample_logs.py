"""Writes the sample logs next to this file: python tests/data/logs/make_sample_logs.py

Small, made-up runs of the bundled small model on 8 GPUs (DP 1, TP 2, PP 4), printed in the
formats of Megatron-LM core_v0.16.1 (README.md names the source of each line). The numbers are
invented but consistent: throughput = the model's FLOPs / time, memory grows until the last
report. tests/experiments/test_experiments.py asserts values read off the files.
"""
from pathlib import Path

OUT = Path(__file__).resolve().parent
GLOBAL_BATCH, TRAIN_ITERS = 32, 8
FLOPS_PER_MS = {1024: 3562.5, 3072: 3562.5 * 3.09}
"""TFLOP/s/GPU x ms for one iteration of this model and batch on 8 GPUs."""
LOSSES = [10.876543, 10.412207, 9.873310, 9.402118, 9.018842, 8.701935, 8.455121, 8.270964]
STAGE_MEMORY = {  # (allocated, max allocated) MB of the first TP rank of each pipeline rank
    "1f1b": [(1410.21, 6121.57), (1302.77, 5104.33), (1301.90, 4301.61), (1398.44, 3688.05)],
    "v-half": [(1402.05, 3398.12), (1311.47, 3351.90), (1309.08, 3340.55), (1315.62, 3329.41)],
    "auto": [(1402.05, 3051.77), (1311.47, 2998.30), (1309.08, 2987.12), (1315.62, 2975.64)],
    "v-zb": [(1402.05, 6893.10), (1311.47, 6877.42), (1309.08, 6860.95), (1315.62, 6851.33)],
    "v-min": [(1402.05, 5911.60), (1311.47, 5860.04), (1309.08, 5844.77), (1315.62, 5831.20)],
}
PLAN = "INFO:megatron_vshape.megatron.forward_backward:[vshape] "
"""The plugin logs through Python logging (here with logging.basicConfig's default format)."""
OOM_TRACE = [
    "[rank2]: Traceback (most recent call last):",
    '[rank2]:   File "/opt/megatron-vshape/scripts/pretrain_gpt_vshape.py", line 212, in <module>',
    "[rank2]:     main()",
    '[rank2]:   File "/opt/Megatron-LM/megatron/core/transformer/mlp.py", line 181, in forward',
    "[rank2]:     intermediate_parallel = self.activation_func(intermediate_parallel)",
    "[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 2 has a "
    "total capacity of 79.19 GiB of which 1.02 GiB is free. Including non-PyTorch memory, this "
    "process has 78.16 GiB memory in use.",
    "W0602 14:01:20.331000 140234 torch/distributed/elastic/multiprocessing/api.py:900] Sending "
    "process 51822 closing signal SIGTERM",
    "E0602 14:01:21.012000 140234 torch/distributed/elastic/multiprocessing/api.py:874] failed "
    "(exitcode: 1) local_rank: 2 (pid: 51824) of binary: /usr/bin/python",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
]


def arguments(schedule: str, mbs: int, seq: int, changes: dict) -> list[str]:
    """arguments.py:_print_args: name, 48 - len(name) dots, value; sorted ignoring case."""
    values = {
        "accumulate_allreduce_grads_in_fp32": "True",
        "account_for_embedding_in_pipeline_split": "False",
        "account_for_loss_in_pipeline_split": "False", "attention_backend": "AttnBackend.flash",
        "bf16": "True", "clip_grad": "1.0", "data_parallel_size": "1", "eval_iters": "0",
        "ffn_hidden_size": "3072", "fp16": "False", "global_batch_size": str(GLOBAL_BATCH),
        "hidden_size": "768", "log_interval": "1", "log_memory_interval": str(TRAIN_ITERS),
        "log_throughput": "True", "lr": "0.0001", "micro_batch_size": str(mbs),
        "mock_data": "True", "num_attention_heads": "12", "num_layers": "14",
        "padded_vocab_size": "51200", "pipeline_memory_limit": "None",
        "pipeline_model_parallel_size": "4", "pipeline_p2p_timeout": "600",
        "pipeline_replan_after": "0", "pipeline_schedule": schedule, "rank": "0",
        "seq_length": str(seq), "sequence_parallel": "True", "tensor_model_parallel_size": "2",
        "tokenizer_type": "NullTokenizer", "train_iters": str(TRAIN_ITERS),
        "transformer_impl": "transformer_engine", "use_distributed_optimizer": "True",
        "virtual_pipeline_model_parallel_size": "None", "world_size": "8",
    } | changes
    rows = ["  {} {} {}".format(k, "." * (48 - len(k)), v) for k, v in values.items()]
    return (["------------------------ arguments ------------------------"]
            + sorted(rows, key=lambda x: x.lower())
            + ["-------------------- end of arguments ---------------------"])


def iteration(it: int, ms: float, seq: int, clock: int) -> str:
    """training.py:training_log (with --log-throughput)."""
    stamp = f"2025-06-02 14:{clock // 60:02d}:{clock % 60:02d}.{(it * 137911) % 1000000:06d}"
    return (f" [{stamp}] iteration {it:8d}/{TRAIN_ITERS:8d} |"
            f" consumed samples: {it * GLOBAL_BATCH:12d} | elapsed time per iteration (ms): {ms:.1f} |"
            f" throughput per GPU (TFLOP/s/GPU): {FLOPS_PER_MS[seq] / ms:.1f} |"
            f" learning rate: {1e-4:.6E} | global batch size: {GLOBAL_BATCH:5d} |"
            f" lm loss: {LOSSES[it - 1]:.6E} | loss scale: 1.0 | grad norm: {14.2 / it + 0.9:.3f} |"
            f" number of skipped iterations:   0 | number of nan iterations:   0 |")


def memory(it: int, stages: list) -> list[str]:
    """utils.py:report_memory on every TP x PP rank (DP rank 0), ranks 2s and 2s+1 on stage s."""
    grow = 1.0 if it == TRAIN_ITERS else (0.97 if it == 2 else 0.91)
    lines = []
    for rank in range(2 * len(stages)):
        alloc, peak = stages[rank // 2]
        alloc, peak = alloc - 3.25 * (rank % 2), (peak - 7.5 * (rank % 2)) * grow
        lines.append(f"[Rank {rank}] (after {it} iterations) memory (MB) | allocated: {alloc:.2f} | "
                     f"max allocated: {peak:.2f} | reserved: {peak + 512.0:.2f} | "
                     f"max reserved: {peak + 1024.0:.2f}")
    return lines


def timers(ms: float) -> list[str]:
    fb = ms - 15.0
    return ["(min, max) time across ranks (ms):",
            f"    forward-backward ...............................: ({fb - 2.31:.2f}, {fb:.2f})",
            "    optimizer ......................................: (11.02, 11.87)"]


def head(name: str, schedule: str) -> list[str]:
    return [f"[launcher] run {name} on 1 x 8 GPUs, 2025-06-02T14:00:00+00:00",
            f"[launcher] command: torchrun --nnodes 1 --nproc-per-node 8 --standalone "
            f"/opt/megatron-vshape/scripts/pretrain_gpt_vshape.py --pipeline-schedule {schedule} ...",
            "using world size: 8, data-parallel size: 1, context-parallel size: 1, hierarchical "
            "context-parallel sizes: None, tensor-model-parallel size: 2, pipeline-model-parallel "
            "size: 4",
            "Number of virtual stages per pipeline stage: None"]


def run_log(name, schedule, times, plans, changes=None, fail=(), exit_status=0, mbs=1, seq=1024,
            prefix=""):
    """One run: launcher lines, argument dump, the plan line, iterations with memory reports
    after iterations 1, 2 and the last, a re-plan after iteration 5, failure, exit status."""
    lines = head(name, schedule) + arguments(schedule, mbs, seq, changes or {})
    lines += ["> building NullTokenizer tokenizer ...",
              " > padded vocab (size: 51201) with 127 dummy tokens (new size: 51328)",
              "> initializing torch distributed ...",
              "[after megatron is initialized] datetime: 2025-06-02 14:00:41 ", plans[0],
              "[after model, optimizer, and learning rate scheduler are built] datetime: "
              "2025-06-02 14:01:02 ",
              "[after dataloaders are built] datetime: 2025-06-02 14:01:03 ", "training ...",
              "[before the start of training step] datetime: 2025-06-02 14:01:03 "]
    clock = 64
    for it, ms in enumerate(times, start=1):
        clock += int(ms / 1000) + 1
        lines.append(iteration(it, ms, seq, clock))
        if it in (1, 2, TRAIN_ITERS):
            lines += memory(it, STAGE_MEMORY[schedule])
        lines += timers(ms)
        if it == 5:
            lines += plans[1:]
    lines += fail
    if exit_status is not None:
        lines.append(f"[launcher] run {name} exit status {exit_status}")
    (OUT / f"{name}.log").write_text("\n".join(prefix + line for line in lines) + "\n")


def main() -> None:
    p = "small-s1024-gb32-dp1-tp2-pp4-mbs1"
    run_log(f"{p}-1f1b", "1f1b", [9204.8, 1651.2, 1633.9, 1630.4, 1628.7, 1631.5, 1629.9, 1627.3],
            [PLAN + "schedule=1f1b ranks=4 microbatches=32 peak_memory_vs_1f1b=1.0000 "
             "bubble_rate=0.0857 memory_limit=none description=1f1b block, interval 2, bound 4 units"],
            changes={"account_for_embedding_in_pipeline_split": "True",
                     "account_for_loss_in_pipeline_split": "True"})
    run_log(f"{p}-v-half", "v-half", [9123.4, 1502.7, 1490.2, 1480.5, 1484.1, 1479.9, 1482.6, 1481.3],
            [PLAN + "schedule=v-half ranks=4 microbatches=32 peak_memory_vs_1f1b=0.7500 "
             "bubble_rate=0.0476 memory_limit=none description=v-half block, interval 6, bound 3 units"])
    run_log(f"{p}-auto-mem0.5", "auto", [9301.1, 1522.4, 1519.8, 1517.0, 1516.2, 1498.8, 1497.5, 1499.4],
            [PLAN + "schedule=auto ranks=4 microbatches=32 peak_memory_vs_1f1b=0.5000 "
             "bubble_rate=0.0714 memory_limit=2.0 description=auto: v-min block, interval 6, bound 2 "
             "units (limit 2 units)",
             PLAN + "re-planning auto from measured costs F,B,W,COMM=[1.0, 1.21, 0.83, 0.04]",
             PLAN + "schedule=auto ranks=4 microbatches=32 peak_memory_vs_1f1b=0.5000 "
             "bubble_rate=0.0526 memory_limit=2.0 description=auto: V family block, offsets k=1 on ranks 1..2, "
             "k=3 after, replayed in time (window 2) (limit 2 units)"],
            changes={"pipeline_memory_limit": "0.5", "pipeline_replan_after": "5"})
    run_log("small-s1024-gb32-dp1-tp2-pp4-mbs2-v-zb", "v-zb", [9688.0],
            [PLAN + "schedule=v-zb ranks=4 microbatches=16 peak_memory_vs_1f1b=1.0000 "
             "bubble_rate=0.0159 memory_limit=none description=v-zb block, interval 6, bound 4 units"],
            fail=OOM_TRACE, exit_status=1, mbs=2)
    run_log("small-s3072-gb32-dp1-tp2-pp4-mbs1-v-min", "v-min", [11702.3, 4405.2, 4398.7, 4401.9],
            [PLAN + "schedule=v-min ranks=4 microbatches=32 peak_memory_vs_1f1b=0.5000 "
             "bubble_rate=0.1000 memory_limit=none description=v-min block, interval 6, bound 2 units"],
            exit_status=None, seq=3072, prefix="0: ")


if __name__ == "__main__":
    main()
