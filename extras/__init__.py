"""extras/: the opt-in parts of tigpo. train.py imports each module only when a flag or a missing
resource asks for it, so a one-GPU run with a local model and given games never loads them:
vllm_engine (--rollout-engine vllm), distributed (torchrun, --fsdp), offline_model (the default
model without the hub), alfworld_gen (no ALFWorld data given), webshop (--env webshop),
cpu_sampling and machine (on a CPU: the sampling fast path, the CPU's kind for config.json), plot
and export_graph (command-line tools). Imports run one way: these modules may import envs and tigpo,
which never import extras."""
