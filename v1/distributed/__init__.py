"""Distribution over existing engines: tensor-parallel process groups and collectives
(`parallel_state`), the sharder that splits a built model across ranks (`tensor_parallel`),
and the worker processes behind the EngineCore (`worker_proc`, `mp_executor`, `ray_executor`)."""
