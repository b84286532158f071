#!/usr/bin/env bash
# Keys and certificates for the NATS server that the coordinator replicas share: a CA, the server's
# TLS certificate, and one nkey per credential the replicas use (docs/deploy.md, "NATS: authentication
# and TLS"). Needs openssl and python3 (its standard library only). Nothing here is committed.
#
#   deploy/nats-certs.sh init [DIR [HOST...]]   # creates what DIR lacks (never overwrites): the CA, a server
#                                               # certificate for HOSTs, the nkey "coordinator", users.conf
#   deploy/nats-certs.sh server-cert DIR [HOST...]   # a new server certificate from the same CA (rotation)
#   deploy/nats-certs.sh nkey DIR NAME          # a new nkey NAME (rotation: a second one beside the first)
#   deploy/nats-certs.sh users DIR              # users.conf again, from the NAME.pub files in DIR
#
# DIR (default deploy/nats/secrets, mode 0700) then holds:
#   ca.pem           the CA certificate: every replica's --nats-tls-ca
#   ca-key.pem       the CA's key (0600): only signs server certificates; keep it off the servers
#   server.pem, server-key.pem   nats-server's tls { cert_file, key_file }; HOSTs (default: nats localhost
#                    127.0.0.1) are its names: what the replicas' --nats-url says
#   NAME.nk          an nkey seed (SU…): a replica's --nats-nkey, secret
#   NAME.pub         its public key (U…)
#   users.conf       nats-server's authorization { }: one user per NAME.pub in DIR (nats.conf includes it)
# The files are written in place (same inode), so that single-file bind mounts see new contents. Keys
# are readable (0644) inside the private directory, because a container reads them as its own user.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DEFAULT_HOSTS=(nats localhost 127.0.0.1)
DAYS_CA=${DAYS_CA:-3650}
DAYS_SERVER=${DAYS_SERVER:-825}

say() { echo "nats-certs: $*" >&2; }
die() { say "$*"; exit 1; }
quiet() { local out; out=$("$@" 2>&1) || die "$1 failed: $out"; }

ca() {  # DIR
  local dir=$1
  (umask 077; quiet openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$dir/ca-key.pem")
  quiet openssl req -x509 -new -key "$dir/ca-key.pem" -out "$dir/ca.pem" -days "$DAYS_CA" \
    -subj "/CN=darkbloom NATS CA $(date -u +%Y-%m-%d)" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
  say "CA: $dir/ca.pem"
}

server_cert() {  # DIR HOST...
  local dir=$1 names="" host
  shift
  for host in "$@"; do
    if [[ $host =~ ^[0-9.]+$ || $host == *:* ]]; then names+="IP:$host,"; else names+="DNS:$host,"; fi
  done
  quiet openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$dir/server-key.pem.new"
  quiet openssl req -new -key "$dir/server-key.pem.new" -subj "/CN=$1" -out "$dir/server.csr"
  quiet openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" \
    -set_serial "0x$(openssl rand -hex 16)" -days "$DAYS_SERVER" -out "$dir/server.pem.new" \
    -extfile <(printf 'subjectAltName=%s\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n' "${names%,}")
  cat "$dir/server-key.pem.new" >"$dir/server-key.pem"
  cat "$dir/server.pem.new" >"$dir/server.pem"
  rm -f "$dir/server-key.pem.new" "$dir/server.pem.new" "$dir/server.csr"
  chmod 644 "$dir/server-key.pem" "$dir/server.pem"
  say "server certificate for ${names%,}: $dir/server.pem"
}

nkey() {  # DIR NAME: an Ed25519 key from openssl, encoded as NATS nkeys (base32 of prefix + key + CRC-16)
  local dir=$1 name=$2 seed_hex public_hex
  [[ $name =~ ^[A-Za-z0-9_.-]+$ ]] || die "an nkey name is letters, digits, '.', '_' and '-': $name"
  [ -e "$dir/$name.nk" ] && die "$dir/$name.nk exists already"
  local key=$dir/$name.ed25519.pem
  (umask 077; quiet openssl genpkey -algorithm ed25519 -out "$key")
  seed_hex=$(openssl pkey -in "$key" -outform DER | od -An -tx1 -v | tr -d ' \n' | tail -c 64)
  public_hex=$(openssl pkey -in "$key" -pubout -outform DER | od -An -tx1 -v | tr -d ' \n' | tail -c 64)
  rm -f "$key"
  python3 - "$seed_hex" "$public_hex" "$dir/$name" <<'EOF'
import base64, binascii, sys

def encode(header: bytes, key_hex: str) -> str:
    data = header + bytes.fromhex(key_hex)
    return base64.b32encode(data + binascii.crc_hqx(data, 0).to_bytes(2, "little")).decode().rstrip("=")

user, seed = 20 << 3, 18 << 3
seed_hex, public_hex, path = sys.argv[1:]
with open(path + ".nk", "w") as out:
    out.write(encode(bytes([seed | user >> 5, (user & 31) << 3]), seed_hex) + "\n")
with open(path + ".pub", "w") as out:
    out.write(encode(bytes([user]), public_hex) + "\n")
EOF
  chmod 644 "$dir/$name.nk" "$dir/$name.pub"
  say "nkey $name: $dir/$name.nk (seed, for --nats-nkey), $(cat "$dir/$name.pub")"
}

users() {  # DIR
  local dir=$1 pub
  {
    echo "# written by deploy/nats-certs.sh from the .pub files beside it: one user per nkey"
    echo "authorization {"
    echo "  users = ["
    for pub in "$dir"/*.pub; do
      [ -e "$pub" ] && echo "    {nkey: \"$(cat "$pub")\"}  # $(basename "$pub" .pub)"
    done
    echo "  ]"
    echo "}"
  } >"$dir/users.conf"
  chmod 644 "$dir/users.conf"
  say "users.conf: $(grep -c 'nkey:' "$dir/users.conf") nkey(s) (reload nats-server to apply)"
}

init() {  # DIR HOST...
  local dir=$1
  shift
  [ "$#" -gt 0 ] || set -- "${DEFAULT_HOSTS[@]}"
  mkdir -p "$dir"
  chmod 700 "$dir"
  [ -s "$dir/ca.pem" ] || ca "$dir"
  [ -s "$dir/server.pem" ] || server_cert "$dir" "$@"
  [ -s "$dir/coordinator.nk" ] || { nkey "$dir" coordinator; users "$dir"; }
  [ -s "$dir/users.conf" ] || users "$dir"
}

command -v openssl >/dev/null || die "openssl is missing"
command -v python3 >/dev/null || die "python3 is missing"
case "${1:-}" in
  init) shift; dir=${1:-$HERE/nats/secrets}; shift || true; init "$dir" "$@" ;;
  server-cert)
    [ "$#" -ge 2 ] || die "usage: $0 server-cert DIR [HOST...]"
    dir=$2; shift 2; [ "$#" -gt 0 ] || set -- "${DEFAULT_HOSTS[@]}"; server_cert "$dir" "$@" ;;
  nkey) [ "$#" = 3 ] || die "usage: $0 nkey DIR NAME"; nkey "$2" "$3"; users "$2" ;;
  users) [ "$#" = 2 ] || die "usage: $0 users DIR"; users "$2" ;;
  *) echo "usage: $0 init [DIR [HOST...]] | server-cert DIR [HOST...] | nkey DIR NAME | users DIR" >&2; exit 2 ;;
esac
