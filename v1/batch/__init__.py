"""Offline batch jobs (`v1 batch`): transcribe, embed or generate over a corpus, on one machine
or over a Ray cluster (Ray Data), into resumable output shards."""

from v1.batch.job import BatchJob
from v1.batch.runner import BatchReport, run_batch

__all__ = ["BatchJob", "BatchReport", "run_batch"]
