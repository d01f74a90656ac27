"""`rackserve router`: P/D (``--prefill URL,.. --decode URL,..``) or plain (``--engines``)."""

from __future__ import annotations

import argparse
import logging

from rackserve.router.policies import POLICIES


def _urls(text: str | None) -> list[str]:
    return [u.strip() for u in (text or "").split(",") if u.strip()]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "router", help="OpenAI-compatible router over engines (P/D or KV-aware)"
    )
    p.add_argument("--prefill", help="prefill engine URLs, comma-separated (P/D mode)")
    p.add_argument("--decode", help="decode engine URLs, comma-separated (P/D mode)")
    p.add_argument("--engines", help="aggregated engine URLs, comma-separated (plain mode)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", choices=POLICIES, default="kv-aware")
    p.add_argument(
        "--kv-events",
        help="ZMQ endpoints of the engines' KV events (tcp://h:p,...), in --engines order "
        "(a DP engine's rank r publishes on port + r: subscribed once its DP size is known); "
        "without them kv-aware uses the router's own record of what it routed",
    )
    p.add_argument("--model", help="model directory: tokenizer and block sizes (with --kv-events)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --model)")
    p.add_argument("--prefix-caching-hash-algo", default="sha256", choices=("sha256", "xxhash"))
    p.add_argument("--load-weight", type=float, default=0.5, help="kv-aware: cost of load")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between checks")
    p.add_argument("--max-retries", type=int, default=3)
    p.add_argument(
        "--overlap-transfer", action="store_true",
        help="P/D: send the decode request with the prefill one (its KV streams in while the "
        "prompt is prefilled) once the prefill engine's KV address is known",
    )  # fmt: skip
    p.add_argument(
        "--no-first-token-from-prefill", dest="first_token_from_prefill", action="store_false",
        help="P/D: stream every chunk from the decode engine (by default a streamed request's "
        "first token goes to the client from the prefill engine's answer)",
    )  # fmt: skip
    p.set_defaults(func=run)


def build_router(args: argparse.Namespace):
    from rackserve.router.app import Router, RouterSettings
    from rackserve.router.engines import EnginePool
    from rackserve.router.kv_index import EventSubscriber, KVIndex, TokenKeyer

    engines, prefill, decode = _urls(args.engines), _urls(args.prefill), _urls(args.decode)
    if engines and (prefill or decode):
        raise ValueError("give --engines (plain) or --prefill with --decode (P/D), not both")
    if not engines and not (prefill and decode):
        raise ValueError("give --engines URL,... or both --prefill URL,... and --decode URL,...")
    events = _urls(args.kv_events)
    main_urls = engines or prefill
    keyer, index, subscriber = None, None, None
    if events:
        if len(events) != len(main_urls):
            raise ValueError(
                f"--kv-events lists {len(events)} endpoints for {len(main_urls)} engines "
                "(one per engine, same order)"
            )
        if not args.model:
            raise ValueError("--kv-events needs --model (to hash prompts as the engines do)")
        keyer = TokenKeyer(args.model, args.tokenizer, args.prefix_caching_hash_algo)
        index = KVIndex(len(main_urls))
        subscriber = EventSubscriber(index, events)
    kwargs = {"keyer": keyer, "index": index, "approximate": subscriber is None}
    settings = RouterSettings(
        health_interval_s=args.health_interval, max_retries=max(0, args.max_retries),
        overlap_transfer=args.overlap_transfer,
        first_token_from_prefill=args.first_token_from_prefill,
    )  # fmt: skip
    if engines:
        pool = EnginePool(engines, "engine", args.policy, load_weight=args.load_weight, **kwargs)
        subscribe_ranks(pool, subscriber, events)
        return Router(engines=pool, settings=settings), subscriber
    prefill_pool = EnginePool(
        prefill, "prefill", args.policy, load_weight=args.load_weight, **kwargs
    )
    subscribe_ranks(prefill_pool, subscriber, events)
    decode_pool = EnginePool(decode, "decode", "least-load")
    return Router(prefill=prefill_pool, decode=decode_pool, settings=settings), subscriber


def subscribe_ranks(pool, subscriber, events: list[str]) -> None:
    """A DP rank candidate the pool learns gets its rank's KV events (kv/events.py)."""
    from rackserve.kv.events import rank_endpoint

    if subscriber is None:
        return
    endpoint_of = dict(zip([e.url for e in pool.engines], events, strict=True))

    def on_new_rank(index: int, url: str, rank: int) -> None:
        subscriber.add(rank_endpoint(endpoint_of[url], rank), index)

    pool.on_new_rank = on_new_rank


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    router, subscriber = build_router(args)
    mode = "P/D" if router.prefill is not None else f"{args.policy} over engines"
    print(f"rackserve router ({mode}) on http://{args.host}:{args.port}", flush=True)
    try:
        web.run_app(router.build_app(), host=args.host, port=args.port, print=None)
    finally:
        if subscriber is not None:
            subscriber.close()
    return 0
