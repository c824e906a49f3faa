//! Multi-node tests: real swarms over TCP on 127.0.0.1 with certificates made by `hypha-certs`.

#![allow(clippy::unwrap_used)] // tests fail loudly by design

use std::{sync::Arc, time::Duration};

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use hypha_certs::{
    NodeIdentity, Role, Roles, TrustStore,
    authority::{self, Authority, Reason, Validity},
};
use hypha_network::{
    InboundRequest, Network, NetworkError, RequestFailure, Settings, StreamProtocol, paths::Path,
};
use libp2p::{Multiaddr, PeerId, multiaddr::Protocol};
use tokio::sync::mpsc;

struct Pki {
    root: Authority,
    org: Authority,
}

impl Pki {
    fn new() -> Self {
        let root = authority::create_root("Net Test Root", Validity::days(10)).unwrap();
        let org = authority::create_org(&root, "Net Test Org", Validity::days(10)).unwrap();
        Pki { root, org }
    }

    fn trust(&self) -> Arc<TrustStore> {
        Arc::new(TrustStore::from_pem(self.root.cert_pem().as_bytes(), &[]).unwrap())
    }

    /// A node that may act in every role.
    fn node(&self, name: &str) -> NodeIdentity {
        self.node_with(name, Roles::ALL)
    }

    /// A node whose certificate grants `roles` (none: a role-less certificate).
    fn node_with(&self, name: &str, roles: Roles) -> NodeIdentity {
        identity_of(
            &authority::create_node(&self.org, name, &[], roles, Validity::days(1)).unwrap(),
        )
    }

    /// A node whose certificate expired yesterday.
    fn expired(&self) -> NodeIdentity {
        let now = time::OffsetDateTime::now_utc();
        let validity = Validity {
            not_before: now - time::Duration::days(3),
            not_after: now - time::Duration::days(1),
        };
        identity_of(
            &authority::create_node(&self.org, "expired", &[], Roles::ALL, validity).unwrap(),
        )
    }

    /// A node, and a trust store whose CRL revokes its certificate.
    fn revoked(&self) -> (NodeIdentity, TrustStore) {
        let node = authority::create_node(&self.org, "revoked", &[], Roles::ALL, Validity::days(1))
            .unwrap();
        let crl = authority::revoke(
            &self.org,
            None,
            node.cert_pem().as_bytes(),
            Reason::KeyCompromise,
            30,
        )
        .unwrap();
        let store =
            TrustStore::from_pem(self.root.cert_pem().as_bytes(), &[crl.as_bytes()]).unwrap();
        (identity_of(&node), store)
    }
}

fn identity_of(node: &authority::NodeCredentials) -> NodeIdentity {
    NodeIdentity::from_pem(node.chain_pem().as_bytes(), node.key_pem().as_bytes()).unwrap()
}

fn loopback() -> Multiaddr {
    "/ip4/127.0.0.1/tcp/0".parse().unwrap()
}

fn settings(kind: &str, listen: bool, gateways: &[Multiaddr]) -> Settings {
    let mut s = Settings::new(kind);
    if listen {
        s.listen_addresses = vec![loopback()];
    }
    s.gateway_addresses = gateways.to_vec();
    s.relay_circuit = false;
    s
}

async fn start(
    identity: &NodeIdentity,
    trust: Arc<TrustStore>,
    settings: Settings,
) -> (Network, mpsc::Receiver<InboundRequest>) {
    hypha_network::start(settings, identity, trust)
        .await
        .unwrap()
}

/// The node's first listen address with its peer id appended.
async fn address_of(network: &Network) -> Multiaddr {
    let addr = network.listen_addresses().await.unwrap().remove(0);
    addr.with(Protocol::P2p(network.local_peer_id()))
}

async fn gateway(pki: &Pki) -> (Network, Multiaddr) {
    let mut s = settings("gateway", true, &[]);
    s.relay_server = true;
    let (net, _inbound) = start(&pki.node("gateway"), pki.trust(), s).await;
    // The gateway answers health itself, so the inbound queue is not needed.
    let addr = address_of(&net).await;
    (net, addr)
}

async fn eventually<T, F, Fut>(what: &str, mut attempt: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(v) = attempt().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn handshake_across_root_org_node_chain_and_health_round_trip() {
    let pki = Pki::new();
    let (server, server_addr) = gateway(&pki).await;
    let client_id = pki.node("client");
    let (client, _) = start(&client_id, pki.trust(), settings("worker", false, &[])).await;

    let peer = client.dial(server_addr).await.unwrap();
    assert_eq!(
        peer,
        server.local_peer_id(),
        "peer id comes from the server certificate"
    );
    let status = client.health(peer).await.unwrap();
    assert_eq!(status.kind, "gateway");
    assert!(status.healthy);
    assert!(status.connected_peers >= 1);

    server.set_health(false, "disk full").await.unwrap();
    let status = client.health(peer).await.unwrap();
    assert!(!status.healthy);
    assert_eq!(status.detail, "disk full");
    assert!(
        server
            .connected_peers()
            .await
            .unwrap()
            .contains(&client_id.peer_id()),
        "the server knows the client by its certificate's peer id"
    );
}

/// A worker node named "client" of `pki`, listening nowhere.
async fn worker_client(pki: &Pki) -> Network {
    start(
        &pki.node("client"),
        pki.trust(),
        settings("worker", false, &[]),
    )
    .await
    .0
}

/// A stream of a protocol the peer accepts no streams of fails as such, so that a caller
/// does not try it again (issue 39: the request's failure typed by its cause).
#[tokio::test]
async fn a_stream_the_peer_does_not_accept_fails_as_an_unsupported_protocol() {
    let pki = Pki::new();
    let (server, server_addr) = gateway(&pki).await;
    let client = worker_client(&pki).await;
    let peer = client.dial(server_addr).await.unwrap();
    let opened = client
        .open_stream(peer, StreamProtocol::new("/hypha/nobody-accepts/1"))
        .await;
    match opened {
        Err(NetworkError::Request { peer: to, failure }) => {
            assert_eq!(to, server.local_peer_id());
            assert_eq!(failure, RequestFailure::UnsupportedProtocol);
            assert!(!failure.is_transient());
        }
        other => panic!("expected an unsupported protocol, got {other:?}"),
    }
    // A protocol taken twice on one node is said to be so.
    let protocol = StreamProtocol::new("/hypha/accepted-once/1");
    let _first = server.accept_streams(protocol.clone()).unwrap();
    assert!(matches!(
        server.accept_streams(protocol),
        Err(NetworkError::AcceptorTaken { .. })
    ));
}

/// Starts `listener` (trusting our root, so it would take the dialer), dials it from `dialer`
/// trusting `dialer_trust`, and expects the handshake to fail with no connection on either
/// side: a refused peer never reaches the protocols.
async fn assert_no_connection(
    pki: &Pki,
    listener: NodeIdentity,
    dialer: NodeIdentity,
    dialer_trust: Arc<TrustStore>,
) {
    let (server, _) = start(&listener, pki.trust(), settings("gateway", true, &[])).await;
    let server_addr = address_of(&server).await;
    let (client, _) = start(&dialer, dialer_trust, settings("worker", false, &[])).await;
    let err = client.dial(server_addr).await.unwrap_err();
    assert!(matches!(err, NetworkError::Dial { .. }), "{err}");
    assert!(client.connected_peers().await.unwrap().is_empty());
    assert!(
        !server
            .connected_peers()
            .await
            .unwrap()
            .contains(&dialer.peer_id()),
        "a refused handshake leaves no connection"
    );
}

/// A node of ours refuses `identity`, which dials it trusting `trust`.
async fn assert_refused(pki: &Pki, identity: NodeIdentity, trust: Arc<TrustStore>) {
    assert_no_connection(pki, pki.node("gateway"), identity, trust).await;
}

#[tokio::test]
async fn certificate_from_another_ca_is_refused() {
    let pki = Pki::new();
    let other = Pki::new();
    // The stranger trusts our root, so only our side's verification stops it.
    assert_refused(&pki, other.node("stranger"), pki.trust()).await;
}

#[tokio::test]
async fn expired_certificate_is_refused() {
    let pki = Pki::new();
    assert_refused(&pki, pki.expired(), pki.trust()).await;
}

#[tokio::test]
async fn revoked_certificate_is_refused() {
    let pki = Pki::new();
    let (revoked_id, trust_with_crl) = pki.revoked();
    let trust_with_crl = Arc::new(trust_with_crl);

    let mut s = settings("gateway", true, &[]);
    s.relay_server = true;
    let (server, _) = start(&pki.node("gateway"), trust_with_crl, s).await;
    let server_addr = address_of(&server).await;
    let (client, _) = start(&revoked_id, pki.trust(), settings("worker", false, &[])).await;
    assert!(client.dial(server_addr.clone()).await.is_err());
    assert!(
        !server
            .connected_peers()
            .await
            .unwrap()
            .contains(&revoked_id.peer_id())
    );

    // Another certificate of the same organisation still gets in.
    let (honest, _) = start(
        &pki.node("honest"),
        pki.trust(),
        settings("worker", false, &[]),
    )
    .await;
    honest.dial(server_addr).await.unwrap();
}

#[tokio::test]
async fn key_that_does_not_match_its_certificate_is_refused() {
    // A node cannot even be configured with a mismatched pair (NodeIdentity refuses it), so this
    // plays a malicious peer by hand: multistream-select to our protocol, then a TLS client
    // presenting certificate A while signing with key B.
    use futures_rustls::TlsConnector;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    let pki = Pki::new();
    let (server, server_addr) = gateway(&pki).await;
    let a = authority::create_node(&pki.org, "a", &[], Roles::ALL, Validity::days(1)).unwrap();
    let b = authority::create_node(&pki.org, "b", &[], Roles::ALL, Validity::days(1)).unwrap();
    let a_id = identity_of(&a);
    let b_id = identity_of(&b);

    #[derive(Debug)]
    struct AcceptAnything;
    impl rustls::client::danger::ServerCertVerifier for AcceptAnything {
        fn verify_server_cert(
            &self,
            _: &rustls::pki_types::CertificateDer<'_>,
            _: &[rustls::pki_types::CertificateDer<'_>],
            _: &rustls::pki_types::ServerName<'_>,
            _: &[u8],
            _: rustls::pki_types::UnixTime,
        ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            _: &[u8],
            _: &rustls::pki_types::CertificateDer<'_>,
            _: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
        }
        fn verify_tls13_signature(
            &self,
            _: &[u8],
            _: &rustls::pki_types::CertificateDer<'_>,
            _: &rustls::DigitallySignedStruct,
        ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
            Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
        }
        fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
            vec![rustls::SignatureScheme::ED25519]
        }
    }
    #[derive(Debug)]
    struct MismatchedKey(Arc<rustls::sign::CertifiedKey>);
    impl rustls::client::ResolvesClientCert for MismatchedKey {
        fn resolve(
            &self,
            _: &[&[u8]],
            _: &[rustls::SignatureScheme],
        ) -> Option<Arc<rustls::sign::CertifiedKey>> {
            Some(self.0.clone())
        }
        fn has_certs(&self) -> bool {
            true
        }
    }

    let rustls::pki_types::PrivateKeyDer::Pkcs8(b_key) = b_id.private_key() else {
        panic!("hypha keys are PKCS#8")
    };
    let signing_key = rustls::crypto::ring::sign::any_eddsa_type(&b_key).unwrap();
    let forged = Arc::new(rustls::sign::CertifiedKey::new(
        a_id.chain().to_vec(),
        signing_key,
    ));
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])
    .unwrap()
    .dangerous()
    .with_custom_certificate_verifier(Arc::new(AcceptAnything))
    .with_client_cert_resolver(Arc::new(MismatchedKey(forged)));

    let port = server_addr
        .iter()
        .find_map(|p| match p {
            Protocol::Tcp(port) => Some(port),
            _ => None,
        })
        .unwrap();
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    // multistream-select 1.0: length-prefixed, newline-terminated protocol names.
    for line in [
        "/multistream/1.0.0\n",
        &format!("{}\n", hypha_network::tls::PROTOCOL_NAME),
    ] {
        tcp.write_all(&[line.len() as u8]).await.unwrap();
        tcp.write_all(line.as_bytes()).await.unwrap();
    }
    for expected in [
        "/multistream/1.0.0\n",
        &format!("{}\n", hypha_network::tls::PROTOCOL_NAME),
    ] {
        let len = tcp.read_u8().await.unwrap() as usize;
        let mut answer = vec![0u8; len];
        tcp.read_exact(&mut answer).await.unwrap();
        assert_eq!(
            answer,
            expected.as_bytes(),
            "the server speaks our TLS upgrade"
        );
    }
    let socket = tokio_util::compat::TokioAsyncReadCompatExt::compat(tcp);
    let name = rustls::pki_types::ServerName::try_from("peer")
        .unwrap()
        .to_owned();
    let result = async {
        let mut tls = TlsConnector::from(Arc::new(config))
            .connect(name, socket)
            .await?;
        // A TLS 1.3 client finishes before the server has judged its certificate; the verdict
        // arrives as an alert on the first read.
        tls.write_all(b"/multistream/1.0.0\n").await?;
        tls.flush().await?;
        let mut buf = [0u8; 1];
        let n = tls.read(&mut buf).await?;
        std::io::Result::Ok(n)
    }
    .await;
    assert!(
        matches!(result, Err(_) | Ok(0)),
        "the server must reject a certificate whose key did not sign the handshake: {result:?}"
    );
    assert!(
        !server
            .connected_peers()
            .await
            .unwrap()
            .contains(&a_id.peer_id())
    );
}

#[tokio::test]
async fn plain_libp2p_noise_peer_is_refused() {
    let pki = Pki::new();
    let (server, server_addr) = gateway(&pki).await;
    let mut stranger = libp2p::SwarmBuilder::with_new_identity()
        .with_tokio()
        .with_tcp(
            libp2p::tcp::Config::default(),
            libp2p::noise::Config::new,
            libp2p::yamux::Config::default,
        )
        .unwrap()
        .with_behaviour(|_| libp2p::ping::Behaviour::default())
        .unwrap()
        .build();
    let stranger_id = *stranger.local_peer_id();
    stranger.dial(server_addr).unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match stranger.select_next_some().await {
                libp2p::swarm::SwarmEvent::ConnectionEstablished { .. } => return "connected",
                libp2p::swarm::SwarmEvent::OutgoingConnectionError { .. } => return "refused",
                _ => {}
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(outcome, "refused");
    assert!(
        !server
            .connected_peers()
            .await
            .unwrap()
            .contains(&stranger_id)
    );
}

/// A worker `a` and a scheduler `b` that listen on no address of their own, joined to the
/// gateway at `gateway_addr`: the relay circuit is the only way in. Returned once `a` holds
/// its reservation and `b` its gateway connection.
/// Waits until `node` listens through a gateway's relay.
async fn relay_reservation_of(node: &Network) {
    eventually("a relay reservation", || async {
        node.listen_addresses()
            .await
            .unwrap()
            .iter()
            .any(|addr| addr.iter().any(|p| p == Protocol::P2pCircuit))
            .then_some(())
    })
    .await;
}

async fn reachable_only_through_the_relay(
    pki: &Pki,
    gateway_addr: &Multiaddr,
) -> (Network, Network) {
    let mut a_settings = settings("worker", false, std::slice::from_ref(gateway_addr));
    a_settings.relay_circuit = true;
    let (a, _) = start(&pki.node("a"), pki.trust(), a_settings).await;
    let mut b_settings = settings("scheduler", false, std::slice::from_ref(gateway_addr));
    b_settings.relay_circuit = true;
    let (b, _) = start(&pki.node("b"), pki.trust(), b_settings).await;
    relay_reservation_of(&a).await;
    eventually("b's gateway connection", || async {
        (!b.connected_peers().await.unwrap().is_empty()).then_some(())
    })
    .await;
    (a, b)
}

#[tokio::test]
async fn nodes_without_direct_reachability_talk_through_the_gateway_relay() {
    let pki = Pki::new();
    let (_gateway, gateway_addr) = gateway(&pki).await;
    let (a, b) = reachable_only_through_the_relay(&pki, &gateway_addr).await;

    // No connect first: a request finds its way like a stream does (known addresses, the DHT,
    // then the relay), since b knows nothing of a but its ID.
    let status = b.health(a.local_peer_id()).await.unwrap();
    assert_eq!(status.kind, "worker");

    // Bulk bytes flow over the relayed connection too.
    let protocol = StreamProtocol::new("/test/echo/1");
    let mut incoming = a.accept_streams(protocol.clone()).unwrap();
    tokio::spawn(async move {
        while let Some((_, mut stream)) = incoming.next().await {
            let mut buf = Vec::new();
            stream.read_to_end(&mut buf).await.unwrap();
            stream.write_all(&buf).await.unwrap();
            stream.close().await.unwrap();
        }
    });
    let mut stream = b.open_stream(a.local_peer_id(), protocol).await.unwrap();
    let payload = vec![7u8; 256 * 1024];
    stream.write_all(&payload).await.unwrap();
    stream.close().await.unwrap();
    let mut echoed = Vec::new();
    stream.read_to_end(&mut echoed).await.unwrap();
    assert_eq!(echoed, payload);
}

/// A direct connection that comes after the punch window finds a request and a stream under
/// way on the relay: neither is cut. The relay stays until they are done (before, it was closed
/// 30 s after the direct connection came, whatever it carried: the stream below broke then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_under_way_on_a_relay_outlives_the_direct_connection_that_replaces_it() {
    let pki = Pki::new();
    let (_gateway, gateway_addr) = gateway(&pki).await;
    // a listens where b never dials (b excludes it), so b reaches a through the relay; the
    // direct connection comes when the test opens a way: a forwarder to a's port that b dials.
    let mut a_settings = settings("worker", false, std::slice::from_ref(&gateway_addr));
    a_settings.listen_addresses = vec!["/ip4/127.0.0.2/tcp/0".parse().unwrap()];
    a_settings.relay_circuit = true;
    let (a, mut a_inbound) = start(&pki.node("a"), pki.trust(), a_settings).await;
    let mut b_settings = settings("scheduler", false, std::slice::from_ref(&gateway_addr));
    b_settings.exclude_cidr = vec!["127.0.0.2/32".parse().unwrap()];
    let (b, _) = start(&pki.node("b"), pki.trust(), b_settings).await;
    relay_reservation_of(&a).await;
    let protocol = StreamProtocol::new("/test/echo-lines/1");
    let mut incoming = a.accept_streams(protocol.clone()).unwrap();
    tokio::spawn(async move {
        while let Some((_, mut stream)) = incoming.next().await {
            let mut byte = [0u8; 1];
            while stream.read_exact(&mut byte).await.is_ok() {
                if stream.write_all(&byte).await.is_err() {
                    break;
                }
            }
        }
    });
    let echo = async |stream: &mut hypha_network::Stream, byte: u8| {
        stream.write_all(&[byte]).await?;
        let mut back = [0u8; 1];
        stream.read_exact(&mut back).await?;
        assert_eq!(back, [byte]);
        std::io::Result::Ok(())
    };

    // b reaches a only through the relay (a has no address of its own), past the window.
    let mut stream = b.open_stream(a.local_peer_id(), protocol).await.unwrap();
    echo(&mut stream, 1).await.unwrap();
    let path_to_a = async || {
        let paths = b.paths().await.unwrap();
        paths
            .into_iter()
            .find(|(peer, _)| *peer == a.local_peer_id())
            .map(|(_, path)| path)
    };
    assert_eq!(path_to_a().await, Some(Path::Relayed));
    let request = {
        let b = b.clone();
        let a = a.local_peer_id();
        tokio::spawn(async move { b.request(a, cancel()).await })
    };
    let asked = a_inbound.recv().await.unwrap();

    // Now a direct connection: b dials a through the forwarder.
    let a_port = a
        .listen_addresses()
        .await
        .unwrap()
        .into_iter()
        .find_map(|address| {
            address.iter().find_map(|p| match p {
                Protocol::Tcp(port) if !address.iter().any(|p| p == Protocol::P2pCircuit) => {
                    Some(port)
                }
                _ => None,
            })
        });
    let forwarder = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let forwarded = forwarder.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = forwarder.accept().await {
            let a_port = a_port.expect("a listens on a TCP port");
            let mut to_a = tokio::net::TcpStream::connect(("127.0.0.2", a_port))
                .await
                .unwrap();
            tokio::spawn(async move {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut to_a).await;
            });
        }
    });
    let through_forwarder: Multiaddr =
        format!("/ip4/127.0.0.1/tcp/{forwarded}/p2p/{}", a.local_peer_id())
            .parse()
            .unwrap();
    b.dial(through_forwarder).await.unwrap();
    eventually("b reaches a directly", || async {
        (path_to_a().await == Some(Path::Direct)).then_some(())
    })
    .await;
    asked
        .responder
        .respond(hypha_messages::Response::Ack)
        .await
        .unwrap();
    let answer = request.await.unwrap();
    assert!(
        answer.is_ok(),
        "the request under way is answered: {answer:?}"
    );
    tokio::time::sleep(Duration::from_secs(32)).await;
    echo(&mut stream, 2)
        .await
        .expect("the stream under way still runs");
}

/// A gateway bounds what one peer puts through its relay: 3 MB relayed at a share of 1 MB/s
/// take about three seconds. (Without the bound: 70 ms here.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relayed_peer_gets_its_share_of_the_gateways_link_and_no_more() {
    let pki = Pki::new();
    let mut gateway_settings = settings("gateway", true, &[]);
    gateway_settings.relay_server = true;
    gateway_settings.peer_bytes_per_second = Some(1_000_000);
    let (gateway, _) = start(&pki.node("gateway"), pki.trust(), gateway_settings).await;
    let gateway_addr = address_of(&gateway).await;
    let (a, b) = reachable_only_through_the_relay(&pki, &gateway_addr).await;

    let protocol = StreamProtocol::new("/test/sink/1");
    let mut incoming = a.accept_streams(protocol.clone()).unwrap();
    tokio::spawn(async move {
        while let Some((_, mut stream)) = incoming.next().await {
            let mut buf = Vec::new();
            stream.read_to_end(&mut buf).await.unwrap();
            stream
                .write_all(&(buf.len() as u64).to_be_bytes())
                .await
                .unwrap();
            stream.close().await.unwrap();
        }
    });
    let mut stream = b.open_stream(a.local_peer_id(), protocol).await.unwrap();
    let started = std::time::Instant::now();
    stream.write_all(&vec![7u8; 3_000_000]).await.unwrap();
    stream.close().await.unwrap();
    let mut count = [0u8; 8];
    stream.read_exact(&mut count).await.unwrap();
    let took = started.elapsed();
    assert_eq!(u64::from_be_bytes(count), 3_000_000);
    assert!(
        took >= Duration::from_millis(2_500),
        "3 MB relayed in {took:?}"
    );
}

async fn cluster(pki: &Pki, n: usize) -> (Network, Vec<Network>) {
    let (gw, gw_addr) = gateway(pki).await;
    let mut nodes = Vec::new();
    for i in 0..n {
        let (net, _) = start(
            &pki.node(&format!("node-{i}")),
            pki.trust(),
            settings("worker", true, std::slice::from_ref(&gw_addr)),
        )
        .await;
        nodes.push(net);
    }
    for net in &nodes {
        eventually("gateway connection", || async {
            net.connected_peers()
                .await
                .unwrap()
                .contains(&gw.local_peer_id())
                .then_some(())
        })
        .await;
    }
    (gw, nodes)
}

#[tokio::test]
async fn kademlia_provider_records_are_found_across_five_nodes() {
    let pki = Pki::new();
    let (_gw, nodes) = cluster(&pki, 4).await;
    for net in &nodes {
        net.bootstrap().await.ok();
    }
    nodes[0]
        .start_providing(b"dataset/imagenet-1k")
        .await
        .unwrap();
    nodes[1]
        .start_providing(b"dataset/imagenet-1k")
        .await
        .unwrap();
    let expected: std::collections::HashSet<PeerId> =
        [nodes[0].local_peer_id(), nodes[1].local_peer_id()].into();
    let found = eventually("both providers", || async {
        let found = nodes[3]
            .get_providers(b"dataset/imagenet-1k")
            .await
            .unwrap();
        (found == expected).then_some(found)
    })
    .await;
    assert_eq!(found, expected);
    assert!(
        nodes[2]
            .get_providers(b"dataset/unknown")
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn gossip_reaches_five_nodes() {
    let pki = Pki::new();
    let (gw, nodes) = cluster(&pki, 4).await;
    let mut all = nodes.clone();
    all.push(gw);
    let mut receivers = Vec::new();
    for net in &all[1..] {
        receivers.push(net.subscribe("hypha/worker", 16).await.unwrap());
    }
    let _publisher_sub = all[0].subscribe("hypha/worker", 16).await.unwrap();
    // Publishing fails until the publisher has seen subscribers; retry until it goes out.
    eventually("a peer subscribed to the topic", || async {
        all[0]
            .publish("hypha/worker", b"advert-1".to_vec())
            .await
            .ok()
    })
    .await;
    for rx in &mut receivers {
        let msg = tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(msg.data, b"advert-1");
        assert_eq!(
            msg.source,
            Some(all[0].local_peer_id()),
            "messages are signed by their author"
        );
    }
}

#[tokio::test]
async fn one_gibibyte_stream_arrives_byte_exact() {
    const TOTAL: usize = 1024 * 1024 * 1024;
    const BLOCK: usize = 1024 * 1024;
    let pki = Pki::new();
    let (server, server_addr) = gateway(&pki).await;
    let client = worker_client(&pki).await;
    client.dial(server_addr).await.unwrap();

    let protocol = StreamProtocol::new("/test/bulk/1");
    let mut incoming = server.accept_streams(protocol.clone()).unwrap();
    let receiver = tokio::spawn(async move {
        let (_, mut stream) = incoming.next().await.unwrap();
        let mut hasher = blake3::Hasher::new();
        let mut buf = vec![0u8; BLOCK];
        let mut total = 0usize;
        loop {
            let n = stream.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            total += n;
        }
        (total, hasher.finalize())
    });

    let mut stream = client
        .open_stream(server.local_peer_id(), protocol)
        .await
        .unwrap();
    let mut block: Vec<u8> = (0..BLOCK).map(|i| (i * 31 % 251) as u8).collect();
    let mut hasher = blake3::Hasher::new();
    for i in 0..TOTAL / BLOCK {
        // Every block differs, so a dropped, repeated or reordered block changes the hash.
        block[..8].copy_from_slice(&(i as u64).to_le_bytes());
        hasher.update(&block);
        stream.write_all(&block).await.unwrap();
    }
    stream.close().await.unwrap();
    let (received, digest) = receiver.await.unwrap();
    assert_eq!(received, TOTAL);
    assert_eq!(digest, hasher.finalize());
}

#[tokio::test]
async fn excluded_ranges_are_never_dialled_even_when_the_dht_names_them() {
    let pki = Pki::new();
    let (_gw, gw_addr) = gateway(&pki).await;
    // The provider listens on 127.0.0.2; the others reach the gateway on 127.0.0.1.
    let mut provider_settings = settings("data", false, std::slice::from_ref(&gw_addr));
    provider_settings.listen_addresses = vec!["/ip4/127.0.0.2/tcp/0".parse().unwrap()];
    let (provider, _) = start(&pki.node("provider"), pki.trust(), provider_settings).await;

    let mut careful_settings = settings("scheduler", false, std::slice::from_ref(&gw_addr));
    careful_settings.exclude_cidr = vec!["127.0.0.2/32".parse().unwrap()];
    let (careful, _) = start(&pki.node("careful"), pki.trust(), careful_settings).await;
    let (plain, _) = start(
        &pki.node("plain"),
        pki.trust(),
        settings("scheduler", false, std::slice::from_ref(&gw_addr)),
    )
    .await;

    eventually("provider on the gateway", || async {
        (!provider.connected_peers().await.unwrap().is_empty()).then_some(())
    })
    .await;
    provider.start_providing(b"k").await.unwrap();
    for net in [&careful, &plain] {
        eventually("the provider record", || async {
            net.get_providers(b"k")
                .await
                .unwrap()
                .contains(&provider.local_peer_id())
                .then_some(())
        })
        .await;
    }

    // Both learned the provider's address through the DHT; only one may use it.
    plain.connect(provider.local_peer_id()).await.unwrap();
    let err = careful.connect(provider.local_peer_id()).await.unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("/ip4/127.0.0.2") && message.contains("exclude_cidr"),
        "the DHT-learned address was refused by the transport: {message}"
    );
    let direct = provider_addr(&provider).await;
    let err = careful.dial(direct).await.unwrap_err();
    assert!(err.to_string().contains("exclude_cidr"), "{err}");
}

async fn provider_addr(net: &Network) -> Multiaddr {
    address_of(net).await
}

/// Where a capturing subscriber writes.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn a_dispatched_jobs_secrets_reach_no_span_or_log_on_either_side() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::TRACE)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::NEW)
        .with_ansi(false)
        .finish();
    // The test's runtime runs every task on this thread: both nodes log here.
    let _default = tracing::subscriber::set_default(subscriber);

    let pki = Pki::new();
    let (worker, mut inbound) = start(
        &pki.node("worker"),
        pki.trust(),
        settings("worker", true, &[]),
    )
    .await;
    let (scheduler, _) = start(
        &pki.node("scheduler"),
        pki.trust(),
        settings("scheduler", false, &[]),
    )
    .await;
    let peer = scheduler.dial(address_of(&worker).await).await.unwrap();
    let spec = hypha_messages::job::JobSpec {
        id: "job".into(),
        task: "task".into(),
        lease: 1,
        executor: hypha_messages::market::ExecutorRef {
            class: "train".into(),
            name: "x".into(),
        },
        config: "{}".into(),
        secrets: std::collections::BTreeMap::from([(
            "HF_TOKEN".to_string(),
            "hf_the_secret_value".to_string(),
        )])
        .into(),
        artifacts: Vec::new(),
        artifact_peers: 0,
        task_peers: hypha_messages::job::TaskPeers::default(),
    };
    let answering = tokio::spawn(async move {
        let request: InboundRequest = inbound.recv().await.unwrap();
        tracing::debug!(request = ?request.request, "received");
        request
            .responder
            .respond(hypha_messages::Response::Ack)
            .await
            .unwrap();
    });
    scheduler
        .request(peer, hypha_messages::Request::Dispatch(spec))
        .await
        .unwrap();
    answering.await.unwrap();

    let logged = String::from_utf8_lossy(&captured.0.lock().unwrap()).to_string();
    assert!(
        logged.contains("request=\"dispatch\"") || logged.contains("request=dispatch"),
        "the rpc span names the request's kind:\n{logged}"
    );
    assert!(logged.contains("HF_TOKEN"), "{logged}");
    assert!(!logged.contains("hf_the_secret_value"), "{logged}");
}

/// A dialer of ours, trusting `client_trust`, refuses a listener presenting `server_identity`.
async fn assert_dialer_refuses(
    server_identity: NodeIdentity,
    pki: &Pki,
    client_trust: Arc<TrustStore>,
) {
    assert_no_connection(pki, server_identity, pki.node("client"), client_trust).await;
}

/// The dialing side checks the listener's chain as strictly as the listener checks the
/// dialer's: each of these servers accepts our nodes, so only the dialer's check stops them.
/// (Checked by making `PeerVerifier::verify_server_cert` accept anything: all three fail.)
#[tokio::test]
async fn a_listener_with_a_foreign_expired_or_revoked_certificate_is_refused_by_the_dialer() {
    let pki = Pki::new();

    let stranger = Pki::new().node("stranger");
    assert_dialer_refuses(stranger, &pki, pki.trust()).await;

    assert_dialer_refuses(pki.expired(), &pki, pki.trust()).await;

    let (revoked_id, trust_with_crl) = pki.revoked();
    let trust_with_crl = Arc::new(trust_with_crl);
    assert_dialer_refuses(revoked_id, &pki, trust_with_crl).await;
}

/// Sends `request` from a node with `roles` to a node that does or does not
/// `allow_roleless`; returns the answer and whether the receiving application saw the request.
async fn send_as(
    roles: Roles,
    allow_roleless: bool,
    request: hypha_messages::Request,
) -> (Result<hypha_messages::Response, NetworkError>, bool) {
    let pki = Pki::new();
    let mut receiver_settings = settings("worker", true, &[]);
    receiver_settings.allow_roleless = allow_roleless;
    let (receiver, mut inbound) = start(
        &pki.node_with("receiver", Role::Worker.into()),
        pki.trust(),
        receiver_settings,
    )
    .await;
    let (sender, _) = start(
        &pki.node_with("sender", roles),
        pki.trust(),
        settings("scheduler", false, &[]),
    )
    .await;
    let peer = sender.dial(address_of(&receiver).await).await.unwrap();
    let answering = tokio::spawn(async move {
        let request = inbound.recv().await.unwrap();
        request
            .responder
            .respond(hypha_messages::Response::Ack)
            .await
            .unwrap();
    });
    let answer = sender.request(peer, request).await;
    let seen = tokio::time::timeout(Duration::from_millis(500), answering)
        .await
        .is_ok();
    (answer, seen)
}

fn cancel() -> hypha_messages::Request {
    hypha_messages::Request::Cancel {
        job: "job-1".into(),
    }
}

fn assert_forbidden(answer: Result<hypha_messages::Response, NetworkError>, role: &str) {
    match answer {
        Err(NetworkError::Remote { error, .. }) => {
            assert_eq!(error.code, hypha_messages::ErrorCode::Forbidden, "{error}");
            assert!(
                error.message.contains(role),
                "the refusal names the role: {error}"
            );
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// Only a scheduler's certificate lets its holder cancel a job (and lease, and dispatch); a
/// worker's does not, and a role-less one only where the receiver allows role-less peers.
/// (Checked by making `required_role` answer `None`: the refusals fail.)
#[tokio::test]
async fn a_request_needs_the_role_its_certificate_grants() {
    let (answer, seen) = send_as(Role::Scheduler.into(), false, cancel()).await;
    assert!(answer.is_ok() && seen, "a scheduler may cancel: {answer:?}");

    let (answer, seen) = send_as(Role::Worker.into(), false, cancel()).await;
    assert_forbidden(answer, "scheduler");
    assert!(!seen, "the application never sees a refused request");

    let (answer, seen) = send_as(Roles::NONE, false, cancel()).await;
    assert_forbidden(answer, "scheduler");
    assert!(!seen);

    let (answer, seen) = send_as(Roles::NONE, true, cancel()).await;
    assert!(
        answer.is_ok() && seen,
        "allow_roleless lets a role-less peer act in every role: {answer:?}"
    );

    // What needs no role, a role-less client may ask.
    let progress = hypha_messages::Request::Progress {
        iteration: "i".into(),
    };
    let (answer, seen) = send_as(Roles::NONE, false, progress).await;
    assert!(answer.is_ok() && seen, "{answer:?}");
}

/// A peer learnt from gossip or the DHT is trusted with a role only once its certificate is
/// seen to grant it.
#[tokio::test]
async fn connect_as_checks_the_role_of_the_peer_reached() {
    let pki = Pki::new();
    let (data, _) = start(
        &pki.node_with("data", Role::Data.into()),
        pki.trust(),
        settings("data", true, &[]),
    )
    .await;
    let (client, _) = start(
        &pki.node_with("client", Roles::NONE),
        pki.trust(),
        settings("client", false, &[]),
    )
    .await;
    client
        .add_address(data.local_peer_id(), address_of(&data).await)
        .await
        .unwrap();
    client
        .connect_as(data.local_peer_id(), Role::Data)
        .await
        .unwrap();
    let err = client
        .connect_as(data.local_peer_id(), Role::Scheduler)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            NetworkError::Role {
                role: Role::Scheduler,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(client.roles(&data.local_peer_id()), Some(Role::Data.into()));
    assert_eq!(
        data.roles(&client.local_peer_id()),
        Some(Roles::NONE),
        "role-less, not allowed"
    );
}

/// A node configured with a gateway whose certificate lacks the gateway role joins it as a
/// peer but never listens through its relay.
#[tokio::test]
async fn only_a_gateway_certified_as_one_relays() {
    let pki = Pki::new();
    let mut s = settings("gateway", true, &[]);
    s.relay_server = true;
    let (impostor, _) = start(
        &pki.node_with("impostor", Role::Worker.into()),
        pki.trust(),
        s,
    )
    .await;
    let impostor_addr = address_of(&impostor).await;
    let mut node_settings = settings("worker", false, std::slice::from_ref(&impostor_addr));
    node_settings.relay_circuit = true;
    let (node, _) = start(&pki.node("node"), pki.trust(), node_settings).await;
    eventually("the connection to the configured gateway", || async {
        node.connected_peers()
            .await
            .unwrap()
            .contains(&impostor.local_peer_id())
            .then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let relayed = node
        .listen_addresses()
        .await
        .unwrap()
        .iter()
        .any(|addr| addr.iter().any(|p| p == Protocol::P2pCircuit));
    assert!(
        !relayed,
        "no relay reservation through a peer that is no gateway"
    );
}

/// A revocation list put in force while a node runs closes the revoked peer's connections
/// and refuses its next dial; other peers stay connected.
/// (Checked by leaving `recheck` out of `replace_trust`: the revoked peer stays connected.)
#[tokio::test]
async fn a_new_revocation_list_disconnects_the_revoked_peer_without_a_restart() {
    let pki = Pki::new();
    let (server, server_addr) = gateway(&pki).await;
    let (revoked_id, store) = pki.revoked();
    let (bad, _) = start(&revoked_id, pki.trust(), settings("worker", false, &[])).await;
    let (good, _) = start(
        &pki.node("good"),
        pki.trust(),
        settings("worker", false, &[]),
    )
    .await;
    bad.dial(server_addr.clone()).await.unwrap();
    good.dial(server_addr.clone()).await.unwrap();

    let closed = server.replace_trust(store).await.unwrap();
    assert_eq!(closed.len(), 1, "{closed:?}");
    assert_eq!(closed[0].0, revoked_id.peer_id());

    eventually("the revoked peer's disconnection", || async {
        (!server
            .connected_peers()
            .await
            .unwrap()
            .contains(&revoked_id.peer_id()))
        .then_some(())
    })
    .await;
    assert!(
        bad.dial(server_addr.clone()).await.is_err(),
        "a revoked peer cannot come back"
    );
    let connected = server.connected_peers().await.unwrap();
    assert!(
        connected.contains(&good.local_peer_id()),
        "others stay: {connected:?}"
    );
}

/// A peer may announce a third party's address (issue 57, item 5): dials to an address that
/// never led to a certified peer stop after three failures in a row, here a plain TCP server
/// that accepts and hangs up, as a web server answers a TLS hello it does not expect. The
/// dial after them fails at once and says why; an address that led to a peer is dialled
/// whenever asked. (Checked without the budget: the fourth dial reaches the server.)
#[tokio::test]
async fn an_address_that_never_led_to_a_peer_is_not_dialled_again_and_again() {
    let pki = Pki::new();
    let third_party = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = third_party.local_addr().unwrap().port();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = accepted.clone();
    let serving = tokio::spawn(async move {
        while let Ok((socket, _)) = third_party.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            drop(socket);
        }
    });
    let client = worker_client(&pki).await;
    let victim: Multiaddr = format!("/ip4/127.0.0.1/tcp/{port}/p2p/{}", pki.node("x").peer_id())
        .parse()
        .unwrap();
    for _ in 0..hypha_network::dial_budget::FREE_FAILURES {
        client.dial(victim.clone()).await.unwrap_err();
    }
    let refused = client.dial(victim.clone()).await.unwrap_err().to_string();
    assert!(refused.contains("never led to a peer"), "{refused}");
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        hypha_network::dial_budget::FREE_FAILURES as usize
    );
    serving.abort();

    // A node's address, proven by a connection, is dialled as often as asked after it went
    // away (a scheduler being restarted).
    let (gateway, address) = gateway(&pki).await;
    client.dial(address.clone()).await.unwrap();
    gateway.shutdown().await;
    for _ in 0..2 * hypha_network::dial_budget::FREE_FAILURES {
        let failed = eventually("the gateway gone", || async {
            client.dial(address.clone()).await.err()
        })
        .await
        .to_string();
        assert!(!failed.contains("never led to a peer"), "{failed}");
    }
}

/// A node whose service comes up after its network answers health checks "starting" until
/// it says it is ready (issue 59, item 7: readiness told by the node, not read from its log).
#[tokio::test]
async fn a_node_not_healthy_at_start_says_starting_until_it_is_ready() {
    let pki = Pki::new();
    let mut s = settings("worker", true, &[]);
    s.healthy_at_start = false;
    let (node, _inbound) = start(&pki.node("worker"), pki.trust(), s).await;
    let address = address_of(&node).await;
    let client = worker_client(&pki).await;
    let peer = client.dial(address).await.unwrap();
    let status = client.health(peer).await.unwrap();
    assert!(!status.healthy, "{status:?}");
    assert!(status.detail.starts_with("starting"), "{}", status.detail);
    node.set_health(true, "ready for advertisements")
        .await
        .unwrap();
    let status = client.health(peer).await.unwrap();
    assert!(status.healthy);
    assert_eq!(status.detail, "ready for advertisements");
}
