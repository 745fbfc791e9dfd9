"""LanguageModelModule's validation sums over several named sets (a pretraining mixture's sources): val/SET/NAME per
set, and the overall val/NAME pooled or weighted by the sets' shares."""

import pytest

from trainer.lm_module import LanguageModelModule


class Sets(LanguageModelModule):
    validation_sums = ("loss", "tokens")
    validation_sets = ("web", "code", "empty")


ROWS = [{"loss": 30.0, "tokens": 10.0}, {"loss": 10.0, "tokens": 10.0}, {"loss": 0.0, "tokens": 0.0}]


def test_pooled_sets():
    metrics = Sets(config=None).validation_set_metrics(ROWS)
    assert metrics == {
        "loss": pytest.approx(2.0),
        "web/loss": 3.0,
        "code/loss": 1.0,
    }  # a set that counted nothing: none


def test_weighted_sets():
    module = Sets(config=None)
    module.validation_set_weights = (0.25, 0.5, 0.25)  # the empty set's share goes to the others, pro rata
    rows = [{"loss": 30.0, "tokens": 10.0}, {"loss": 40.0, "tokens": 40.0}, {"loss": 0.0, "tokens": 0.0}]
    assert module.validation_set_metrics(rows)["loss"] == pytest.approx((3.0 * 0.25 + 1.0 * 0.5) / 0.75)


def test_one_set_is_unchanged():
    class One(LanguageModelModule):
        validation_sums = ("loss", "tokens")

    assert One(config=None).validation_set_metrics([{"loss": 6.0, "tokens": 3.0}]) == {"loss": 2.0}
