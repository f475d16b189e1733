"""Distillation healing: a student (the stage's current model, e.g. a pruned one) trained
on a frozen teacher's logits.

A recipe step::

    training:                       # optional; without it the default pydoc text is used
      files: [train.txt]
      tokens: 1000000
      seq_len: 256
    stages:
      - name: healed
        from: pruned
        steps:
          - method: distill
            teacher: base           # an earlier stage or a model directory (default: the stage's source)
            loss: {forward_kl: 1.0, ce: 0.0, reverse_kl: 0.0, hidden: 0.0}
            temperature: 1.0
            batch_size: 8
            lr: 1.0e-4
            checkpoint_every: 50

Modules: ``losses`` (pure loss functions), ``config`` (the step's settings), ``trainer``
(the loop), ``checkpoint`` (atomic, resumable checkpoints), ``distributed`` (DDP),
``default_text`` (the offline default training text), ``transform`` (the stage step).

Several processes (data parallel; one process per GPU, or CPU processes on gloo)::

    torchrun --nproc_per_node 2 -m compress.cli run recipe.yaml
    accelerate launch --multi_gpu --num_processes 2 -m compress.cli run recipe.yaml   # runs torchrun
    # two machines, 8 GPUs each: on every machine (node_rank 0 and 1)
    torchrun --nnodes 2 --node_rank $RANK --nproc_per_node 8 \
        --rdzv_backend c10d --rdzv_endpoint $HEAD_NODE:29500 -m compress.cli run recipe.yaml
    accelerate launch --multi_gpu --num_machines 2 --machine_rank $RANK --num_processes 16 \
        --main_process_ip $HEAD_NODE --main_process_port 29500 -m compress.cli run recipe.yaml

``batch_size`` is the global batch: each process takes rows ``rank::world_size`` of it.
Every process runs the whole recipe; rank 0 writes the output and evaluates, the others
export to a scratch directory that is removed (``compress/pipeline.py`` run_recipe). On
GPUs each process trains on ``cuda:LOCAL_RANK`` (nccl); on CPUs on gloo. ``parallel:
auto`` / ``ddp`` replicates the student (DDP); ``parallel: fsdp`` shards it with FSDP2
(``fully_shard`` per decoder block, for students that do not fit one device), and
``shard_teacher: true`` shards the frozen teacher too (``distill/distributed.py``).

Checkpoints go to ``<output>/<stage>.distill-checkpoints`` every ``checkpoint_every``
steps and are removed when the step completes; rerunning the same recipe after a crash
or ``kill -9`` resumes from the newest one (bit-identical to an uninterrupted run in one
process); a different recipe is refused until that directory is deleted.
"""
