//! The mutual-TLS security upgrade.
//!
//! Both sides of every connection present their certificate chain and verify the other's against
//! the node's [`TrustStore`]: signatures up to a trusted root, validity dates, CRLs, extended key
//! usage, and an Ed25519 leaf key. The remote [`PeerId`] is derived from that leaf key, so a
//! connection's identity is exactly its certificate. A peer that fails verification never
//! completes the handshake, so no protocol above ever sees it. The chain of a peer that passes
//! is recorded in [`CertifiedPeers`] with the roles it states.
//!
//! The trust store is read at every handshake from a [`Trust`] handle, so a reloaded revocation
//! list applies to the next connection without a restart.
//!
//! Only TLS 1.3 is offered, and AES-128-GCM is preferred over ChaCha20-Poly1305: on CPUs with AES
//! instructions it is about twice as fast, and bulk transfers are bounded by it (see
//! `BENCHMARKS.md`). Session resumption is off, so every connection presents and verifies the
//! full chain.

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::{Arc, PoisonError, RwLock},
};

use crate::certified::CertifiedPeers;
use futures::{AsyncRead, AsyncWrite, FutureExt, future::BoxFuture};
use futures_rustls::TlsStream;
use hypha_certs::{NodeIdentity, PeerRole, Rejection, TrustStore};
use libp2p::{
    PeerId,
    core::upgrade::{InboundConnectionUpgrade, OutboundConnectionUpgrade, UpgradeInfo},
};
use rustls::{
    CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::{CryptoProvider, ring},
    pki_types::{CertificateDer, ServerName, UnixTime},
    server::danger::{ClientCertVerified, ClientCertVerifier},
};

/// The multistream-select name of the upgrade.
pub const PROTOCOL_NAME: &str = "/hypha/mtls/1.0.0";

/// Why a connection could not be secured.
#[derive(Debug, thiserror::Error)]
pub enum UpgradeError {
    #[error("TLS handshake failed: {0}")]
    Handshake(#[source] std::io::Error),
    #[error("the peer's certificate is unusable: {0}")]
    Certificate(#[from] Rejection),
}

/// Why the TLS configuration could not be built from a node's identity.
#[derive(Debug, thiserror::Error)]
#[error("cannot configure TLS with this certificate and key: {0}")]
pub struct ConfigError(#[from] rustls::Error);

/// The trust store handshakes verify peers with, replaceable while the node runs.
#[derive(Debug, Clone)]
pub struct Trust(Arc<RwLock<Arc<TrustStore>>>);

impl Trust {
    pub fn new(store: TrustStore) -> Self {
        Trust(Arc::new(RwLock::new(Arc::new(store))))
    }

    /// The store in force now.
    pub fn current(&self) -> Arc<TrustStore> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Puts `store` in force for every handshake from now on.
    pub fn replace(&self, store: TrustStore) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(store);
    }
}

impl From<TrustStore> for Trust {
    fn from(store: TrustStore) -> Self {
        Trust::new(store)
    }
}

impl From<Arc<TrustStore>> for Trust {
    fn from(store: Arc<TrustStore>) -> Self {
        Trust(Arc::new(RwLock::new(store)))
    }
}

/// The security upgrade: client and server TLS configurations for one node identity.
#[derive(Clone)]
pub struct Config {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
    peers: CertifiedPeers,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("tls::Config").finish_non_exhaustive()
    }
}

impl Config {
    /// Configures TLS for `identity`, accepting peers that `trust` accepts and recording them
    /// in `peers`.
    pub(crate) fn new(
        identity: &NodeIdentity,
        trust: Trust,
        peers: CertifiedPeers,
    ) -> Result<Self, ConfigError> {
        let provider = Arc::new(provider());
        let verifier = Arc::new(PeerVerifier {
            trust,
            provider: provider.clone(),
        });

        let mut client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(verifier.clone())
            .with_client_auth_cert(identity.chain().to_vec(), identity.private_key())?;
        client.resumption = rustls::client::Resumption::disabled();

        let mut server = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(identity.chain().to_vec(), identity.private_key())?;
        server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        server.send_tls13_tickets = 0;

        Ok(Config {
            server: Arc::new(server),
            client: Arc::new(client),
            peers,
        })
    }
}

/// ring's provider with AES-GCM ahead of ChaCha20 (rustls honours the server's order).
fn provider() -> CryptoProvider {
    use ring::cipher_suite::{
        TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256,
    };
    CryptoProvider {
        cipher_suites: vec![
            TLS13_AES_128_GCM_SHA256,
            TLS13_AES_256_GCM_SHA384,
            TLS13_CHACHA20_POLY1305_SHA256,
        ],
        ..ring::default_provider()
    }
}

impl UpgradeInfo for Config {
    type Info = &'static str;
    type InfoIter = std::iter::Once<Self::Info>;

    fn protocol_info(&self) -> Self::InfoIter {
        std::iter::once(PROTOCOL_NAME)
    }
}

impl<C> InboundConnectionUpgrade<C> for Config
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = (PeerId, TlsStream<C>);
    type Error = UpgradeError;
    type Future = BoxFuture<'static, Result<Self::Output, Self::Error>>;

    fn upgrade_inbound(self, socket: C, _: Self::Info) -> Self::Future {
        async move {
            let stream = futures_rustls::TlsAcceptor::from(self.server)
                .accept(socket)
                .await
                .map_err(UpgradeError::Handshake)?;
            let peer = record_peer(&self.peers, stream.get_ref().1)?;
            Ok((peer, stream.into()))
        }
        .boxed()
    }
}

impl<C> OutboundConnectionUpgrade<C> for Config
where
    C: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    type Output = (PeerId, TlsStream<C>);
    type Error = UpgradeError;
    type Future = BoxFuture<'static, Result<Self::Output, Self::Error>>;

    fn upgrade_outbound(self, socket: C, _: Self::Info) -> Self::Future {
        async move {
            // Peers are identified by certificate, not by name: an unspecified IP address as the
            // server name keeps rustls from sending SNI.
            let name = ServerName::IpAddress(IpAddr::V4(Ipv4Addr::UNSPECIFIED).into());
            let stream = futures_rustls::TlsConnector::from(self.client)
                .connect(name, socket)
                .await
                .map_err(UpgradeError::Handshake)?;
            let peer = record_peer(&self.peers, stream.get_ref().1)?;
            Ok((peer, stream.into()))
        }
        .boxed()
    }
}

/// The peer id of a verified handshake's remote side, after recording its chain in `peers`.
fn record_peer(peers: &CertifiedPeers, state: &rustls::CommonState) -> Result<PeerId, Rejection> {
    let chain = state.peer_certificates().ok_or(Rejection::NoCertificate)?;
    let leaf = chain.first().ok_or(Rejection::NoCertificate)?;
    let peer = hypha_certs::peer_id_of_certificate(leaf)?;
    peers.insert(peer, chain.to_vec());
    Ok(peer)
}

/// Verifies the remote chain in both directions with the node's trust store.
#[derive(Debug)]
struct PeerVerifier {
    trust: Trust,
    provider: Arc<CryptoProvider>,
}

impl PeerVerifier {
    fn verify_chain(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
        role: PeerRole,
    ) -> Result<(), rustls::Error> {
        let mut chain = Vec::with_capacity(1 + intermediates.len());
        chain.push(end_entity.clone());
        chain.extend(intermediates.iter().cloned());
        match self.trust.current().verify(&chain, now, role) {
            Ok(_) => Ok(()),
            Err(rejection) => {
                tracing::debug!(%rejection, ?role, "refused a peer's certificate");
                Err(rustls::Error::InvalidCertificate(match rejection {
                    Rejection::Expired => CertificateError::Expired,
                    Rejection::NotYetValid => CertificateError::NotValidYet,
                    Rejection::Revoked => CertificateError::Revoked,
                    Rejection::UnknownIssuer => CertificateError::UnknownIssuer,
                    Rejection::BadSignature => CertificateError::BadSignature,
                    Rejection::WrongUsage => CertificateError::InvalidPurpose,
                    other => CertificateError::Other(rustls::OtherError(Arc::new(other))),
                }))
            }
        }
    }
}

/// The handshake-signature methods, identical for both verifier traits: TLS 1.3 signatures are
/// checked with the provider's algorithms, TLS 1.2 is never negotiated, node keys are Ed25519.
macro_rules! signature_checks {
    () => {
        fn verify_tls12_signature(
            &self,
            _message: &[u8],
            _cert: &CertificateDer<'_>,
            _dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            Err(rustls::Error::PeerIncompatible(
                rustls::PeerIncompatible::Tls12NotOffered,
            ))
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(
                message,
                cert,
                dss,
                &self.provider.signature_verification_algorithms,
            )
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            vec![SignatureScheme::ED25519]
        }
    };
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.verify_chain(end_entity, intermediates, now, PeerRole::Server)?;
        Ok(ServerCertVerified::assertion())
    }

    signature_checks!();
}

impl ClientCertVerifier for PeerVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.verify_chain(end_entity, intermediates, now, PeerRole::Client)?;
        Ok(ClientCertVerified::assertion())
    }

    signature_checks!();
}
