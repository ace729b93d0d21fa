"""The planner: which parallel mode fits a model, and the flags that run it.

    inventory.py  a registry model's weights and activations, from its config (no TF)
    memory.py     bytes per device of one candidate: state (exact), gradients, activations
    zero.py       ZeRO stages: the zero layout, and the paper's formula for its Figure 1
    recommend.py  the candidates, simplest first, and the first that fits
    command.py    `tfdist plan`: flags in; a table or JSON and the command line out
"""
