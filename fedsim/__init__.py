"""fedsim: datasets, evaluation protocols, in-process federation and the `fedrec` CLI."""

from __future__ import annotations

from fedsim.data.datasets import find_data_dir, load_amazon_book, load_dataset
from fedsim.data.kgat import TrainTestSplit, load_kgat
from fedsim.data.loaders import (
    CandidateBlocks,
    LightFRSplit,
    load_filmtrust,
    load_generic,
    load_lightfr_split,
    load_movielens,
)
from fedsim.data.ratings import Ratings
from fedsim.data.splits import Split, chronological_split, leave_one_out
from fedsim.data.synthetic import synthetic
from fedsim.evaluation.experiment import Candidates, Experiment, Protocol, baselines, prepare
from fedsim.evaluation.ranking import (
    EvalResult,
    RankingResult,
    TieMode,
    evaluate_all_items,
    evaluate_candidates,
    evaluate_full_ranking,
    evaluate_sampled,
    hamming_scorer,
    hit_ratio,
    interaction_csr,
    ndcg,
    popularity_scorer,
    popularity_scores,
    random_scorer,
    random_scores,
    sample_negatives,
    sample_test_blocks,
)
from fedsim.federation.lightfr import (
    FederatedLightFR,
    FederationConfig,
    RoundReport,
    UserData,
    run_lightfr,
    user_data,
)

__all__ = [
    "Ratings",
    "LightFRSplit",
    "TrainTestSplit",
    "CandidateBlocks",
    "load_dataset",
    "load_movielens",
    "load_filmtrust",
    "load_generic",
    "load_lightfr_split",
    "load_kgat",
    "load_amazon_book",
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
    "RankingResult",
    "evaluate_all_items",
    "evaluate_sampled",
    "sample_test_blocks",
    "hamming_scorer",
    "popularity_scorer",
    "random_scorer",
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
