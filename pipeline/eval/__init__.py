"""Evaluation: how much of the full cache's recall a method keeps, measured on LoCoMo.

    methods.py        the method and variant language, EvalConfig
    cell.py           one (conversation, method, budget) cell: build, then measure
    window.py         the oracle window: each question's reference in a whole conversation
                      longer than the model
    reads.py          a cell's reads: each method's route and top-up, measured on the cache
                      it picks; a method's record selected from its cell's
    metrics.py        evidence-recall and answer NLLs, F1, retention
    summary.py        retention per question and summaries per method, budget and group
    scorecard.py      the headline measures (answer, copy-free evidence recall), over
                      retrieval, bootstrap intervals and paired differences, each measure's signal
    runner.py         the cells as Ray tasks, finished cells kept for re-runs
    report.py         the evaluation's outputs: Markdown tables, the retention plot
    page.py           the scorecard page: headline, best rows, costs, leads by group and per
                      conversation, signal, plots

How quality is measured, and the figures, are in docs/evaluation.md and docs/quality.md.
"""
