"""The mesh commands that need no server: ``join``, ``invite``, ``node``, ``package`` and
``plan``, each run on the arguments ``cli`` parsed (``serve`` and ``demo`` stay in ``cli``, the
one module that imports the server)."""

from __future__ import annotations

import argparse
from pathlib import Path

from seamline.cli_mesh_args import INVITE_ENV
from seamline.errors import SeamlineError


def cmd_join(args: argparse.Namespace) -> int:
    from seamline.runtime.openmp import node_spin

    node_spin()  # before torch loads: the next import brings it
    from seamline.logs import setup_logging
    from seamline.mesh.node.process import NodeOptions, run_node
    from seamline.model.devices import resolve_device
    from seamline.net.http_guard import raise_descriptor_limit

    setup_logging(args.quiet, args.log_format)
    raise_descriptor_limit()
    resolve_device(args.device)  # a device this machine lacks: one line now, not after the download
    options = NodeOptions(
        data_port=args.data_port,
        progress=not args.no_progress,
        device=args.device,
        reprobe_when_idle=args.reprobe_when_idle,
    )
    if args.max_memory is not None:
        options.max_memory_bytes = int(args.max_memory * (1 << 30))
    if args.node_id:
        options.node_id = args.node_id
    return run_node(invite_token(args), options)


def invite_token(args: argparse.Namespace) -> str:
    """The invite from argv, a file, or the environment (exactly one of them)."""
    import os

    given = [
        (what, value)
        for what, value in (
            ("the command line", args.token),
            ("--token-file", args.token_file),
            (f"${INVITE_ENV}", os.environ.get(INVITE_ENV)),
        )
        if value
    ]
    if len(given) != 1:
        where = " and ".join(what for what, _ in given) or "nowhere"
        raise SeamlineError(
            f"give the invite token once (argv, --token-file or ${INVITE_ENV}); got it from {where}"
        )
    what, value = given[0]
    if what == "--token-file":
        try:
            value = Path(value).read_text()
        except OSError as exc:
            raise SeamlineError(f"cannot read the invite token file: {exc}") from None
    return value.strip()


def cmd_admin(args: argparse.Namespace) -> int:
    """`seamline invite create|list|revoke` and `seamline node remove`."""
    from seamline.mesh.control.admin_client import (
        AdminClient,
        default_state_dir,
        format_invites,
        parse_duration,
    )

    client = AdminClient(Path(args.state_dir) if args.state_dir else default_state_dir(), args.url)
    if args.handler_name == "node":
        client.call("DELETE", f"nodes/{args.id}")
        print(f"removed node {args.id}")
        for invite in client.call("GET", "invites")[
            "invites"
        ]:  # removal revokes the invite it joined with
            if args.id in invite.get("nodes", ()) and invite["state"] == "revoked":
                print(
                    f"revoked invite {invite['id']}, which it joined with: new nodes need a new invite "
                    "(seamline invite create)"
                )
    elif args.action == "create":
        made = client.call(
            "POST", "invites", {"uses": args.uses, "expires_s": parse_duration(args.expires)}
        )
        print(
            f"invite {made['id']} ({'any number of' if args.uses is None else args.uses} uses, "
            f"expires in {args.expires}):\n{made['token']}"
        )
    elif args.action == "list":
        print(format_invites(client.call("GET", "invites")["invites"]))
    else:
        client.call("DELETE", f"invites/{args.id}")
        print(f"revoked invite {args.id}")
    return 0


def cmd_package(args: argparse.Namespace) -> int:
    from seamline.weights.packaging import package

    manifest = package(args.model, args.out)
    total = sum(f.bytes for f in manifest.fragments)
    print(
        f"{len(manifest.fragments)} fragments, {total / 1e6:.1f} MB, model hash {manifest.model_hash[:16]} in {args.out}"
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from seamline.mesh.control.plan_args import plan_sim_options
    from seamline.mesh.control.plan_cli import run_plan_command

    return run_plan_command(
        args.nodes_json,
        args.model,
        args.lock,
        args.context,
        args.batch,
        live_url=args.live,
        tensor_parallel=args.tensor_parallel,
        objective=args.objective,
        sim=plan_sim_options(args),
    )
