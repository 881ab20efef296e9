"""fedsim: datasets, evaluation protocols, in-process federation and the `fedrec` CLI."""

from __future__ import annotations

from fedsim.datasets import (
    CandidateBlocks,
    LightFRSplit,
    Ratings,
    find_data_dir,
    load_dataset,
    load_filmtrust,
    load_generic,
    load_lightfr_split,
    load_movielens,
    synthetic,
)
from fedsim.evaluation import (
    EvalResult,
    TieMode,
    evaluate_candidates,
    evaluate_full_ranking,
    hit_ratio,
    interaction_csr,
    ndcg,
    popularity_scores,
    random_scores,
    sample_negatives,
)
from fedsim.experiment import Candidates, Experiment, Protocol, baselines, prepare
from fedsim.federation import (
    FederatedLightFR,
    FederationConfig,
    RoundReport,
    UserData,
    run_lightfr,
    user_data,
)
from fedsim.splits import Split, chronological_split, leave_one_out

__all__ = [
    "Ratings",
    "LightFRSplit",
    "CandidateBlocks",
    "load_dataset",
    "load_movielens",
    "load_filmtrust",
    "load_generic",
    "load_lightfr_split",
    "synthetic",
    "find_data_dir",
    "Split",
    "chronological_split",
    "leave_one_out",
    "TieMode",
    "EvalResult",
    "interaction_csr",
    "sample_negatives",
    "evaluate_candidates",
    "evaluate_full_ranking",
    "hit_ratio",
    "ndcg",
    "popularity_scores",
    "random_scores",
    "Protocol",
    "Candidates",
    "Experiment",
    "prepare",
    "baselines",
    "FederationConfig",
    "FederatedLightFR",
    "RoundReport",
    "UserData",
    "run_lightfr",
    "user_data",
]
