"""Where a webhook may go: public addresses only, unless private ones are explicitly allowed.

Shared by the API (which refuses a webhook URL at submission) and the webhook worker (which
checks again at delivery, and connects to the address it checked). An IPv6 address that
carries an IPv4 address is judged by the IPv4 address it carries too: `[64:ff9b::a9fe:a9fe]` is
169.254.169.254, the cloud metadata service, however it is written. `_CARRIERS` lists every such
form.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Every IPv6 form that carries an IPv4 address a translator or tunnel delivers to, and where it
# sits: "low32" is the last 32 bits; 6to4 and Teredo are read by the ipaddress module.
_CARRIERS = (
    (ipaddress.ip_network("::ffff:0:0/96"), "low32"),  # IPv4-mapped (RFC 4291)
    (ipaddress.ip_network("::ffff:0:0:0/96"), "low32"),  # IPv4-translated, SIIT (RFC 6145, 2765)
    (ipaddress.ip_network("::/96"), "low32"),  # IPv4-compatible (deprecated; :: and ::1 carry 0.0.0.0, 0.0.0.1)
    (ipaddress.ip_network("64:ff9b::/96"), "low32"),  # NAT64 well-known prefix (RFC 6052)
    (ipaddress.ip_network("2002::/16"), "6to4"),  # 6to4 (RFC 3056): bits 16-47
    (ipaddress.ip_network("2001::/32"), "teredo"),  # Teredo (RFC 4380): server, and client inverted
)
# RFC 8215 local-use NAT64: the IPv4 address may sit at any of RFC 6052's offsets, and the prefix is
# never public, so the whole of it is refused.
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")


class RefusedUrl(ValueError):
    """A webhook URL Ferry will not deliver to; the message says why."""


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """Every IPv4 address an IPv6 address carries (empty for a plain IPv6 address)."""
    found: list[ipaddress.IPv4Address] = []
    for network, where in _CARRIERS:
        if ip not in network:
            continue
        if where == "low32":
            found.append(ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF))
        elif where == "6to4":
            found.append(ip.sixtofour)
        else:
            found.extend(ip.teredo)  # (server, client)
    return found


def is_public(ip: IPAddress) -> bool:
    """A globally routable unicast address, and so is every IPv4 address it carries."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return False
        carried = embedded_ipv4(ip)
        if carried:
            return all(is_public(v4) for v4 in carried)
    return ip.is_global and not ip.is_multicast


def check_url_shape(url: str) -> tuple[str, int]:
    """(host, port) of an http(s) URL; RefusedUrl for anything else."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise RefusedUrl(f"invalid URL: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RefusedUrl("webhook URL must be http(s)://host/...")
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def literal_address(host: str) -> IPAddress | None:
    """The address a host names literally (`127.0.0.1`, `::1`), else None (a name to resolve)."""
    try:
        return ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None


def check_addresses(host: str, addresses: list[IPAddress], allow_private: bool) -> None:
    """RefusedUrl when a host resolved to nothing, or to any non-public address (unless allowed)."""
    if not addresses:
        raise RefusedUrl(f"{host!r} does not resolve")
    if allow_private:
        return
    private = [str(a) for a in addresses if not is_public(a)]
    if private:
        raise RefusedUrl(
            f"{host!r} resolves to non-public address {private[0]} (FERRY_WEBHOOK_ALLOW_PRIVATE is off)"
        )


def resolve(host: str, port: int) -> list[IPAddress]:
    """The addresses `host` resolves to (blocking DNS); RefusedUrl when it does not resolve."""
    literal = literal_address(host)
    if literal is not None:
        return [literal]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise RefusedUrl(f"cannot resolve {host!r}: {exc}") from exc
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
