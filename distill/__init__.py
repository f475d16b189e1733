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
            teacher: base           # an earlier stage or a model directory (default: base)
            loss: {forward_kl: 1.0, ce: 0.0, reverse_kl: 0.0, hidden: 0.0}
            temperature: 1.0
            batch_size: 8
            lr: 1.0e-4
            checkpoint_every: 50

Modules: ``losses`` (pure loss functions), ``config`` (the step's settings), ``trainer``
(the loop), ``checkpoint`` (atomic, resumable checkpoints), ``distributed`` (DDP),
``default_text`` (the offline default training text), ``transform`` (the stage step).

Several processes (data parallel, DDP; one process per GPU, or CPU processes on gloo)::

    torchrun --nproc_per_node 2 -m compress.cli run recipe.yaml
    accelerate launch --num_processes 2 -m compress.cli run recipe.yaml
    # two machines, 8 GPUs each: on every machine (node_rank 0 and 1)
    torchrun --nnodes 2 --node_rank $RANK --nproc_per_node 8 \
        --rdzv_backend c10d --rdzv_endpoint $HEAD_NODE:29500 -m compress.cli run recipe.yaml

``batch_size`` is the global batch: each process takes ``batch_size / world_size`` rows.
"""
