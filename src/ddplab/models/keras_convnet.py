"""The Keras multi-GPU guide's convnet, built with Keras 3 on its torch backend (optional: ``pip install
keras``).

Under ``KERAS_BACKEND=torch`` a Keras model *is* a ``torch.nn.Module``: its
variables are torch parameters, so ddplab's DDP, optimizers, autocast and
checkpoints apply to it unchanged — what the guide does by hand. A thin
adapter passes ``training=`` from torch's train()/eval() to Keras (BatchNorm,
Dropout). Channels-first, because ddplab's batches are (N, C, H, W); the
input scaling the guide does with a Rescaling layer is the dataset's job here.
"""

from __future__ import annotations

import os

from torch import Tensor, nn


class KerasModule(nn.Module):
    """Calls a Keras model with ``training=self.training``."""

    def __init__(self, keras_model: nn.Module):
        super().__init__()
        self.keras_model = keras_model

    def forward(self, x: Tensor) -> Tensor:
        return self.keras_model(x, training=self.training)

    def synced_state(self) -> list[Tensor]:
        """Keras' non-trainable variables (BN moving statistics): ranks share rank 0's before evaluation,
        as they do torch BN buffers (see ddplab.distributed.broadcast_buffers)."""
        return [p.data for p in self.keras_model.parameters() if not p.requires_grad]


def keras_convnet(
    num_classes: int = 10, in_channels: int = 1, image_size: int = 8, dropout: float = 0.5
) -> nn.Module:
    os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is first imported
    try:
        import keras
    except ImportError as e:
        raise ImportError(
            "model=keras_convnet needs Keras 3 with its torch backend. Fix: pip install 'keras>=3' "
            "(or pip install -e '.[keras]')"
        ) from e
    if keras.backend.backend() != "torch":
        raise RuntimeError(
            f"model=keras_convnet: Keras runs on its {keras.backend.backend()!r} backend. Fix: "
            "export KERAS_BACKEND=torch before starting (Keras was imported before ddplab set it)"
        )
    # Fresh name counters: layer names — and so state_dict keys — are the same in every process and run.
    keras.backend.clear_session()
    L, fmt = keras.layers, "channels_first"
    inputs = keras.Input(shape=(in_channels, image_size, image_size))
    x = L.Conv2D(12, 3, padding="same", use_bias=False, data_format=fmt)(inputs)
    x = L.BatchNormalization(axis=1, scale=False, center=True)(x)
    x = L.ReLU()(x)
    # The guide's stride-2 convs use "valid" padding on 28x28 MNIST; "same" keeps 8x8 digits usable.
    x = L.Conv2D(24, 6, strides=2, padding="same", use_bias=False, data_format=fmt)(x)
    x = L.BatchNormalization(axis=1, scale=False, center=True)(x)
    x = L.ReLU()(x)
    x = L.Conv2D(32, 6, strides=2, padding="same", data_format=fmt, name="large_k")(x)
    x = L.BatchNormalization(axis=1, scale=False, center=True)(x)
    x = L.ReLU()(x)
    x = L.GlobalAveragePooling2D(data_format=fmt)(x)
    x = L.Dense(256, activation="relu")(x)
    x = L.Dropout(dropout)(x)
    outputs = L.Dense(num_classes)(x)
    return KerasModule(keras.Model(inputs, outputs))
