"""te_layers: Flax Linen, Flax NNX and Equinox modules built on te_ops.

The layer modules (Dense, Softmax, attention, MoE router and block) land with the layers issue; this
package currently exposes nothing beyond its version.
"""

__version__ = "0.1.0"
