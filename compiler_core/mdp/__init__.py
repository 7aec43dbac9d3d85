"""Multi-device partitioning (MDP): one network over several SoCs.

- `config`: the vendor's partition file (`-mdp-load-partition-config`), parsed and checked
  against the device, and the file `-mdp-dump-partition-config` writes;
- `shard`: tensor slicing of one partition's devices (attention heads and MLP columns/rows
  split, an all-reduce per block, the LM head split by vocabulary);
- `pipeline`: several partitions as pipeline stages (the nodes cut into runs of about equal
  weights, the values crossing a cut sent to the stages that read them);
- `build`: compiling every device's program into one QPC (`device<N>/` segments and
  `mdp_meta_info`);
- `session`: running every device's program together, the links between them modelled.
"""
