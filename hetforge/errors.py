"""The errors that are the user's to fix (bad config, missing input...): the CLI prints them as one
clear line and exits 2, instead of a traceback. Anything else is a bug and keeps its traceback."""

from hetforge.cluster.balance import BalanceError
from hetforge.cluster.dist import ClusterError
from hetforge.config import ConfigError
from hetforge.data.corpus import CorpusError
from hetforge.data.prepare import PrepareError
from hetforge.data.shards import ShardError
from hetforge.data.tokenizer import TokenizerError
from hetforge.evaluate.multiple_choice import TaskError
from hetforge.export.hf import ExportError
from hetforge.memory.milp import PlanError
from hetforge.scaling.laws import ScalingError
from hetforge.train.checkpoint import CheckpointError

USER_ERRORS = (ConfigError, ClusterError, BalanceError, CorpusError, PrepareError, ShardError, TokenizerError, CheckpointError,
               PlanError, ScalingError, ExportError, TaskError)
