#!/bin/sh
# A private CA and the broker's certificate for docker-compose.sasl.yml (PEM: what Kafka's
# PEM keystore and every kvflow client read). Writes deploy/kafka/tls/{ca.pem,broker.pem}.
set -eu
dir="$(dirname "$0")/tls"
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey rsa:2048 -nodes -days 825 -subj "/CN=kvflow-ca" -keyout ca.key -out ca.pem
openssl req -newkey rsa:2048 -nodes -subj "/CN=kafka" -keyout broker.key -out broker.csr
printf "subjectAltName=DNS:kafka,DNS:localhost\n" > san.ext
openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 825 -extfile san.ext -out broker.crt
cat broker.key broker.crt ca.pem > broker.pem
rm -f broker.csr san.ext ca.srl
echo "wrote $dir/ca.pem and $dir/broker.pem"
