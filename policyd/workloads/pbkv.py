"""The three multi-agent workflows PBKV evaluates, as seeded generators.

* ``fact-checking`` (dynamic; HoVer claims run by a LangChain pipeline): planner, then per hop a
  retriever and a verifier, the verifier sending work back to the retriever with a probability
  that grows with the claim's ambiguity and hop count; then a summarizer.
* ``code-writing`` (dynamic; SWE-bench tasks run by AutoGen agents): planner -> coder -> tester,
  then (debugger -> coder -> tester) x r retry rounds, r drawn from a distribution that grows with
  the task's difficulty and size; then a reviewer.
* ``financial`` (static DAG; FinanceBench questions run by a CrewAI crew): planner, three
  statement analysts in parallel (fan-out) each looping over filing lookups, then ratio analyst
  (two iterations), risk analyst, writer.

What a real client would send travels as ``hints`` (``kv_transfer_params``): the task's features
(hops, ambiguity, difficulty, files touched) and the position (step, hop, attempt so far). The
branch outcomes themselves are never in the hints; a predictor has to learn them.

Distributions, with their sources:
* HoVer (Jiang et al., 2020, Table 2): 2/3/4-hop claims are 9,052 / 6,084 / 3,035 of the 18,171
  training claims, i.e. 0.50 / 0.33 / 0.17.
* SWE-bench Verified difficulty annotations (OpenAI, 2024): 196 "<15 min", 261 "15 min-1 h",
  42 "1-4 h", 3 ">4 h" of 500 tasks; we merge the last two into "hard": 0.39 / 0.52 / 0.09.
* Token sizes and tool times are modelled (log-normal, stated per agent below), not measured.
"""

from __future__ import annotations

import math
import random

from policyd.workloads.agents import AgentSpec, WorkflowPrompts, lognormal
from policyd.workloads.calls import Call, Workload


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---- fact-checking ------------------------------------------------------------------------------

FC_PLANNER = AgentSpec("planner", system_tokens=1100, output_median_tokens=140)
FC_RETRIEVER = AgentSpec("retriever", system_tokens=850, output_median_tokens=90)
FC_VERIFIER = AgentSpec("verifier", system_tokens=1000, output_median_tokens=120)
FC_SUMMARIZER = AgentSpec("summarizer", system_tokens=700, output_median_tokens=180)


def research_probability(ambiguity: float, hops: int, retries: int) -> float:
    """P(the verifier sends this hop back to the retriever): ambiguous, many-hop claims are
    re-searched more; each retry makes another one less likely."""
    return _sigmoid(-2.0 + 3.0 * ambiguity + 0.4 * (hops - 2) - 1.0 * retries)


def fact_checking(
    *, seed: int = 0, workflows: int = 200, max_retries: int = 3, mean_search_s: float = 0.8
) -> Workload:
    rng = random.Random(seed)
    streams: list[list[Call]] = []
    for w in range(workflows):
        wid = f"fc{seed}-{w}"
        hops = rng.choices((2, 3, 4), weights=(0.50, 0.33, 0.17))[0]
        ambiguity = round(rng.betavariate(2.0, 3.0), 2)
        claim_tokens = rng.randint(25, 90)
        wp = WorkflowPrompts(
            wid,
            "fact-checking",
            f"claim:{wid}",
            claim_tokens,
            {"hops": hops, "ambiguity": ambiguity, "claim_tokens": claim_tokens},
        )
        plan = FC_PLANNER.output_tokens(rng)
        wp.call(FC_PLANNER, 40, plan, 0.0)
        query = max(20, plan // hops)
        verdicts = 0
        for hop in range(hops):
            retries = 0
            while True:
                found = FC_RETRIEVER.output_tokens(rng)
                search_s = lognormal(rng, mean_search_s, 0.6, 0.05, 20.0)
                wp.call(
                    FC_RETRIEVER, query, found, 0.05, extra_hints={"hop": hop, "retries": retries}
                )
                passages = round(lognormal(rng, 700, 0.5, 150, 4000))
                verdict = FC_VERIFIER.output_tokens(rng)
                wp.call(
                    FC_VERIFIER,
                    found + passages,
                    verdict,
                    search_s,
                    extra_hints={"hop": hop, "retries": retries},
                )
                if retries < max_retries and rng.random() < research_probability(
                    ambiguity, hops, retries
                ):
                    retries += 1
                    query = verdict  # the verifier's feedback is the next query
                    continue
                verdicts += verdict
                query = max(20, plan // hops)
                break
        wp.call(FC_SUMMARIZER, verdicts, FC_SUMMARIZER.output_tokens(rng), 0.05)
        streams.append(wp.finish())
    return Workload(
        "fact-checking",
        streams,
        f"{workflows} HoVer-style claims (2-4 hops), planner/retriever/verifier/summarizer",
    )


# ---- code-writing -------------------------------------------------------------------------------

CW_PLANNER = AgentSpec("planner", system_tokens=1400, output_median_tokens=260)
CW_CODER = AgentSpec("coder", system_tokens=1900, output_median_tokens=600, output_sigma=0.6)
CW_TESTER = AgentSpec("tester", system_tokens=900, output_median_tokens=140)
CW_DEBUGGER = AgentSpec("debugger", system_tokens=1200, output_median_tokens=380)
CW_REVIEWER = AgentSpec("reviewer", system_tokens=1000, output_median_tokens=240)

DIFFICULTY_RETRIES = {"easy": 0.35, "medium": 1.0, "hard": 2.2}


def expected_retries(difficulty: str, files: int) -> float:
    """Mean debug rounds: harder and larger changes fail their tests more often."""
    return DIFFICULTY_RETRIES[difficulty] * (1.0 + 0.3 * (files - 1))


def _poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def code_writing(
    *, seed: int = 0, workflows: int = 200, max_retries: int = 6, median_test_s: float = 6.0
) -> Workload:
    rng = random.Random(seed)
    repos = ("django", "sympy", "astropy", "sphinx", "matplotlib", "scikit-learn", "pytest")
    streams: list[list[Call]] = []
    for w in range(workflows):
        wid = f"cw{seed}-{w}"
        difficulty = rng.choices(("easy", "medium", "hard"), weights=(0.39, 0.52, 0.09))[0]
        files = rng.choices((1, 2, 3, 4), weights=(0.55, 0.25, 0.12, 0.08))[0]
        retries = min(max_retries, _poisson(rng, expected_retries(difficulty, files)))
        issue = round(lognormal(rng, 600, 0.6, 120, 4000))
        code = round(lognormal(rng, 1800 * files, 0.5, 400, 12000))
        wp = WorkflowPrompts(
            wid,
            "code-writing",
            f"task:{wid}",
            issue + code,
            {"difficulty": difficulty, "files": files, "repo": rng.choice(repos)},
        )
        plan = CW_PLANNER.output_tokens(rng)
        wp.call(CW_PLANNER, 40, plan, 0.0)
        patch = CW_CODER.output_tokens(rng)
        wp.call(CW_CODER, plan, patch, 0.05, extra_hints={"attempt": 0})
        report = CW_TESTER.output_tokens(rng)
        wp.call(CW_TESTER, patch, report, 0.3, extra_hints={"attempt": 0})
        for attempt in range(1, retries + 1):
            log = round(lognormal(rng, 900, 0.7, 100, 8000))
            test_s = lognormal(rng, median_test_s, 0.8, 0.5, 300.0)
            diagnosis = CW_DEBUGGER.output_tokens(rng)
            wp.call(CW_DEBUGGER, report + log, diagnosis, test_s, extra_hints={"attempt": attempt})
            patch = CW_CODER.output_tokens(rng)
            wp.call(CW_CODER, diagnosis, patch, 0.05, extra_hints={"attempt": attempt})
            report = CW_TESTER.output_tokens(rng)
            wp.call(CW_TESTER, patch, report, 0.3, extra_hints={"attempt": attempt})
        test_s = lognormal(rng, median_test_s, 0.8, 0.5, 300.0)
        wp.call(CW_REVIEWER, patch + report, CW_REVIEWER.output_tokens(rng), test_s)
        streams.append(wp.finish())
    return Workload(
        "code-writing",
        streams,
        f"{workflows} SWE-bench-style tasks, planner/coder/tester with debug retry loops",
    )


# ---- financial analysis -------------------------------------------------------------------------

FA_PLANNER = AgentSpec("planner", system_tokens=1200, output_median_tokens=220)
FA_ANALYSTS = tuple(
    AgentSpec(f"{kind}_analyst", system_tokens=1300, output_median_tokens=350)
    for kind in ("income", "balance", "cashflow")
)
FA_RATIO = AgentSpec("ratio_analyst", system_tokens=1100, output_median_tokens=300)
FA_RISK = AgentSpec("risk_analyst", system_tokens=1100, output_median_tokens=280)
FA_WRITER = AgentSpec("writer", system_tokens=900, output_median_tokens=450)
FA_ANALYST_ITERATIONS = 3  # ReAct iterations of each statement analyst (tool lookups)


def financial(*, seed: int = 0, workflows: int = 200) -> Workload:
    """Each agent runs its task as a fixed number of ReAct iterations (CrewAI's agent loop: the
    agent calls a tool - a filing lookup - and is called again with the observation appended),
    so an agent reuses its own prefix within its task; the order never depends on content."""
    rng = random.Random(seed)
    streams: list[list[Call]] = []
    for w in range(workflows):
        wid = f"fa{seed}-{w}"
        filing = rng.choice(("10-K", "10-Q", "8-K"))
        evidence = round(lognormal(rng, 4500, 0.45, 1500, 12000))
        wp = WorkflowPrompts(
            wid,
            "financial",
            f"filing:{wid}",
            evidence,
            {"doc_type": filing, "evidence_tokens": evidence},
        )
        plan = FA_PLANNER.output_tokens(rng)
        wp.call(FA_PLANNER, 60, plan, 0.0)
        findings = 0
        # fan-out: the three statement analysts start together, each then loops on its own
        outs = [analyst.output_tokens(rng) for analyst in FA_ANALYSTS]
        for i, analyst in enumerate(FA_ANALYSTS):
            wp.call(analyst, plan, outs[i], 0.05, parallel=i > 0)
        for _ in range(FA_ANALYST_ITERATIONS - 1):
            for i, analyst in enumerate(FA_ANALYSTS):
                observation = round(lognormal(rng, 500, 0.5, 80, 3000))
                lookup_s = lognormal(rng, 0.4, 0.5, 0.05, 5.0)
                outs[i] = analyst.output_tokens(rng)
                wp.call(analyst, observation, outs[i], lookup_s, parallel=i > 0)
        findings = sum(outs)
        ratios = FA_RATIO.output_tokens(rng)
        wp.call(FA_RATIO, findings, ratios, 0.05)
        observation = round(lognormal(rng, 400, 0.5, 80, 3000))
        ratios = FA_RATIO.output_tokens(rng)
        wp.call(FA_RATIO, observation, ratios, lognormal(rng, 0.4, 0.5, 0.05, 5.0))
        risks = FA_RISK.output_tokens(rng)
        wp.call(FA_RISK, findings + ratios, risks, 0.05)
        wp.call(FA_WRITER, findings + ratios + risks, FA_WRITER.output_tokens(rng), 0.05)
        streams.append(wp.finish())
    return Workload(
        "financial",
        streams,
        f"{workflows} FinanceBench-style questions, a static CrewAI DAG with a 3-way fan-out",
    )
