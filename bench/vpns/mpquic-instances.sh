#!/bin/sh
# Writes the PKI and configurations of mpquic in the seed's layout (bench/vpns/mpquic-instances.yaml):
# one server, and three client instances of one site (critical, bulk, default), each its own
# process, TUN device and address, with mpquic's defaults otherwise.
#   mpquic-instances.sh MPQUIC DIR SERVER_ADDR PATH1_IF ID
set -eu
bin=$1 dir=$2 server=$3 wan=$4 id=$5
pki=$dir/pki
port=45018
"$bin" pki init --dir "$pki" --force >/dev/null
"$bin" pki server --dir "$pki" --name mpquic-server --san "$server" >/dev/null
"$bin" pki client --dir "$pki" --name site1 >/dev/null
cat > "$dir/server.yaml" <<CONF
role: server
bind_ip: 0.0.0.0
remote_port: $port
multi_conn_enabled: true
tun_name: mqs$id
tun_cidr: 10.202.0.254/24
tls_cert_file: $pki/mpquic-server.crt
tls_key_file: $pki/mpquic-server.key
control_socket: $dir/server.sock
CONF
n=1
for inst in crit bulk dflt; do
  cat > "$dir/$inst.yaml" <<CONF
role: client
tun_name: $inst$id
tun_cidr: 10.202.0.$n/24
tls_ca_file: $pki/ca.crt
tls_cert_file: $pki/site1.crt
tls_key_file: $pki/site1.key
tls_server_name: mpquic-server
control_socket: $dir/$inst.sock
multipath_paths:
- name: wan1
  bind_ip: if:$wan
  remote_addr: $server
  remote_port: $port
CONF
  n=$((n + 4))
done
