"""Model implementations (one file per architecture), the architecture registry and the
safetensors loader. Shared building blocks live in `v1.models.layers`."""
