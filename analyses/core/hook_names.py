"""The hook names every analysis reads or edits (architecture §2), shared by both backends."""


def z_name(layer: int) -> str:
    """A layer's head outputs before the output projection, (batch, pos, head, d_head)."""
    return f"blocks.{layer}.attn.hook_z"


def pattern_name(layer: int) -> str:
    """A layer's attention patterns, (batch, head, q_pos, k_pos)."""
    return f"blocks.{layer}.attn.hook_pattern"


def resid_pre_name(layer: int) -> str:
    """The residual stream entering a block, (batch, pos, d_model)."""
    return f"blocks.{layer}.hook_resid_pre"


def resid_mid_name(layer: int) -> str:
    """The residual stream between a block's attention and its MLP, (batch, pos, d_model)."""
    return f"blocks.{layer}.hook_resid_mid"


def mlp_out_name(layer: int) -> str:
    """A layer's MLP output, (batch, pos, d_model) (blocks with an MLP only)."""
    return f"blocks.{layer}.hook_mlp_out"


def has_mlps(model) -> bool:
    """Whether every block of ``model`` has an MLP output hook (False for attention-only models)."""
    return all(mlp_out_name(layer) in model.hook_dict for layer in range(model.cfg.n_layers))


def z_names(model) -> list[str]:
    """Every layer's ``hook_z`` name."""
    return [z_name(layer) for layer in range(model.cfg.n_layers)]


def pattern_names(model) -> list[str]:
    """Every layer's ``hook_pattern`` name."""
    return [pattern_name(layer) for layer in range(model.cfg.n_layers)]


def resid_pre_names(model) -> list[str]:
    """Every layer's ``hook_resid_pre`` name."""
    return [resid_pre_name(layer) for layer in range(model.cfg.n_layers)]


def layer_of(name: str) -> int:
    """``blocks.{l}.…`` -> l."""
    return int(name.split(".")[1])


def qkv_name(layer: int, which: str) -> str:
    """A layer's queries, keys or values (``which`` = "q" | "k" | "v"), (batch, pos, head, d_head)
    (keys and values: key/value heads)."""
    return f"blocks.{layer}.attn.hook_{which}"


def qkv_input_name(layer: int, which: str) -> str:
    """Each head's own copy of the residual its query, key or value reads, before ln1
    (batch, pos, head, d_model); fires only with ``set_use_split_qkv_input(True)``."""
    return f"blocks.{layer}.hook_{which}_input"


def final_resid_name(model) -> str:
    """The residual stream leaving the last block: what the final norm and the unembedding read."""
    return f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"


def mlp_post_name(layer: int) -> str:
    """A layer's MLP hidden activation, one value per neuron (batch, pos, d_mlp): what the MLP's
    output projection ``W_out[layer]`` reads (blocks with an MLP only)."""
    return f"blocks.{layer}.mlp.hook_post"
