"""jrl: a JAX-native RL post-training stack for language models."""

__version__ = '0.1.0'
