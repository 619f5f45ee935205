"""puma.eval: exact kNN retrieval and the Recall@k / MAP@R / R-Precision metrics."""

from puma.eval.knn import RetrievalInputError, iter_knn, knn_search
from puma.eval.metrics import evaluate_embeddings, harmonic_mean, retrieval_metrics, unified_labels

__all__ = [
    "RetrievalInputError",
    "evaluate_embeddings",
    "harmonic_mean",
    "iter_knn",
    "knn_search",
    "retrieval_metrics",
    "unified_labels",
]
