"""fedsim: datasets, evaluation protocols, in-process federation and the `fedrec` CLI.

The names re-exported here load their module on first use (PEP 562), so `python -m fedsim.cli --help`
does not load the simulator, the server or scipy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.lazy import lazy_exports

if TYPE_CHECKING:  # the names below, for type checkers; at run time they load on first use (PEP 562)
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

# exported name -> the module that defines it, imported on first use
_LAZY = {
    "find_data_dir": "fedsim.data.datasets",
    "load_amazon_book": "fedsim.data.datasets",
    "load_dataset": "fedsim.data.datasets",
    "TrainTestSplit": "fedsim.data.kgat",
    "load_kgat": "fedsim.data.kgat",
    "CandidateBlocks": "fedsim.data.loaders",
    "LightFRSplit": "fedsim.data.loaders",
    "load_filmtrust": "fedsim.data.loaders",
    "load_generic": "fedsim.data.loaders",
    "load_lightfr_split": "fedsim.data.loaders",
    "load_movielens": "fedsim.data.loaders",
    "Ratings": "fedsim.data.ratings",
    "Split": "fedsim.data.splits",
    "chronological_split": "fedsim.data.splits",
    "leave_one_out": "fedsim.data.splits",
    "synthetic": "fedsim.data.synthetic",
    "Candidates": "fedsim.evaluation.experiment",
    "Experiment": "fedsim.evaluation.experiment",
    "Protocol": "fedsim.evaluation.experiment",
    "baselines": "fedsim.evaluation.experiment",
    "prepare": "fedsim.evaluation.experiment",
    "EvalResult": "fedsim.evaluation.ranking",
    "RankingResult": "fedsim.evaluation.ranking",
    "TieMode": "fedsim.evaluation.ranking",
    "evaluate_all_items": "fedsim.evaluation.ranking",
    "evaluate_candidates": "fedsim.evaluation.ranking",
    "evaluate_full_ranking": "fedsim.evaluation.ranking",
    "evaluate_sampled": "fedsim.evaluation.ranking",
    "hamming_scorer": "fedsim.evaluation.ranking",
    "hit_ratio": "fedsim.evaluation.ranking",
    "interaction_csr": "fedsim.evaluation.ranking",
    "ndcg": "fedsim.evaluation.ranking",
    "popularity_scorer": "fedsim.evaluation.ranking",
    "popularity_scores": "fedsim.evaluation.ranking",
    "random_scorer": "fedsim.evaluation.ranking",
    "random_scores": "fedsim.evaluation.ranking",
    "sample_negatives": "fedsim.evaluation.ranking",
    "sample_test_blocks": "fedsim.evaluation.ranking",
    "FederatedLightFR": "fedsim.federation.lightfr",
    "FederationConfig": "fedsim.federation.lightfr",
    "RoundReport": "fedsim.federation.lightfr",
    "UserData": "fedsim.federation.lightfr",
    "run_lightfr": "fedsim.federation.lightfr",
    "user_data": "fedsim.federation.lightfr",
}


__getattr__, __dir__ = lazy_exports("fedsim", _LAZY, globals())
