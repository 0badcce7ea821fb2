"""Distribution over existing engines: tensor-parallel process groups and collectives
(`parallel_state`) and the sharder that splits a built model across ranks (`tensor_parallel`).
The worker processes behind the EngineCore live in v1/executor."""
