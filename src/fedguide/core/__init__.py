"""What every layer of fedguide uses and that uses nothing of fedguide: atomic writes, seeded random
streams, the flat weight layout, aggregation arithmetic, the wire record, disk-backed client state,
evaluation on a test set, the default local training loop, checksums and sealed safetensors files."""
