#![allow(clippy::unwrap_used)] // tests fail loudly by design

use hypha_certs::{
    Error, NodeIdentity, TrustStore,
    authority::{self, Reason, Validity},
};
use time::{Duration, OffsetDateTime};

fn hierarchy() -> (authority::Authority, authority::Authority) {
    let root = authority::create_root("Test Root", Validity::days(30)).unwrap();
    let org = authority::create_org(&root, "Test Org", Validity::days(30)).unwrap();
    (root, org)
}

fn identity(node: &authority::NodeCredentials) -> NodeIdentity {
    NodeIdentity::from_pem(node.chain_pem().as_bytes(), node.key_pem().as_bytes()).unwrap()
}

#[test]
fn root_org_node_chain_verifies_to_the_certificates_peer_id() {
    let (root, org) = hierarchy();
    let node = authority::create_node(
        &org,
        "n1",
        &["localhost".into(), "127.0.0.1".into()],
        Validity::days(1),
    )
    .unwrap();
    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[]).unwrap();
    let id = identity(&node);
    assert_eq!(
        id.chain().len(),
        2,
        "node presents its certificate and the org CA"
    );
    assert_eq!(
        trust.verify_peer(id.chain(), hypha_certs::now()).unwrap(),
        id.peer_id()
    );
}

#[test]
fn another_ca_is_rejected() {
    let (_, org) = hierarchy();
    let other_root = authority::create_root("Other Root", Validity::days(30)).unwrap();
    let node = authority::create_node(&org, "n1", &[], Validity::days(1)).unwrap();
    let trust = TrustStore::from_pem(other_root.cert_pem().as_bytes(), &[]).unwrap();
    let err = trust
        .verify_peer(identity(&node).chain(), hypha_certs::now())
        .unwrap_err();
    assert!(
        err.to_string().contains("not issued by a trusted CA"),
        "{err}"
    );

    // A CA that impersonates the trusted root's name is caught by the signature.
    let impostor = authority::create_root("Test Root", Validity::days(30)).unwrap();
    let impostor_org = authority::create_org(&impostor, "Test Org", Validity::days(30)).unwrap();
    let forged = authority::create_node(&impostor_org, "n1", &[], Validity::days(1)).unwrap();
    let (root, _) = hierarchy();
    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[]).unwrap();
    let err = trust
        .verify_peer(identity(&forged).chain(), hypha_certs::now())
        .unwrap_err();
    assert!(
        err.to_string().contains("not issued by a trusted CA"),
        "{err}"
    );
}

#[test]
fn expired_certificate_is_rejected() {
    let (root, org) = hierarchy();
    let now = OffsetDateTime::now_utc();
    let validity = Validity {
        not_before: now - Duration::days(10),
        not_after: now - Duration::days(1),
    };
    let node = authority::create_node(&org, "old", &[], validity).unwrap();
    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[]).unwrap();
    let err = trust
        .verify_peer(identity(&node).chain(), hypha_certs::now())
        .unwrap_err();
    assert!(err.to_string().contains("expired"), "{err}");
}

#[test]
fn revoked_certificate_is_rejected_and_others_stay_accepted() {
    let (root, org) = hierarchy();
    let bad = authority::create_node(&org, "bad", &[], Validity::days(1)).unwrap();
    let good = authority::create_node(&org, "good", &[], Validity::days(1)).unwrap();
    let crl = authority::revoke(
        &org,
        None,
        bad.cert_pem().as_bytes(),
        Reason::KeyCompromise,
        30,
    )
    .unwrap();
    // Revoking again keeps earlier entries and bumps the CRL number.
    let third = authority::create_node(&org, "third", &[], Validity::days(1)).unwrap();
    let crl = authority::revoke(
        &org,
        Some(crl.as_bytes()),
        third.cert_pem().as_bytes(),
        Reason::Superseded,
        30,
    )
    .unwrap();
    let described = hypha_certs::inspect::describe(crl.as_bytes(), "crl").unwrap();
    assert!(described.contains("revoked:     2"), "{described}");
    assert!(described.contains("number:      2"), "{described}");

    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[crl.as_bytes()]).unwrap();
    let err = trust
        .verify_peer(identity(&bad).chain(), hypha_certs::now())
        .unwrap_err();
    assert!(err.to_string().contains("revoked"), "{err}");
    assert!(
        trust
            .verify_peer(identity(&third).chain(), hypha_certs::now())
            .is_err()
    );
    assert!(
        trust
            .verify_peer(identity(&good).chain(), hypha_certs::now())
            .is_ok()
    );
}

#[test]
fn revoking_needs_the_certificates_own_issuer() {
    let (root, org) = hierarchy();
    let node = authority::create_node(&org, "n", &[], Validity::days(1)).unwrap();
    let err = authority::revoke(
        &root,
        None,
        node.cert_pem().as_bytes(),
        Reason::Unspecified,
        30,
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("revoke it with its own issuer"),
        "{err}"
    );
}

#[test]
fn key_from_another_certificate_is_refused_at_load() {
    let (_, org) = hierarchy();
    let a = authority::create_node(&org, "a", &[], Validity::days(1)).unwrap();
    let b = authority::create_node(&org, "b", &[], Validity::days(1)).unwrap();
    let err = NodeIdentity::from_pem(a.chain_pem().as_bytes(), b.key_pem().as_bytes()).unwrap_err();
    assert!(matches!(err, Error::KeyMismatch { .. }), "{err}");
}

#[test]
fn an_org_ca_cannot_sign_another_ca() {
    let (_, org) = hierarchy();
    assert!(authority::create_org(&org, "Sub Org", Validity::days(1)).is_err());
}

#[test]
fn authority_round_trips_through_pem() {
    let (root, org) = hierarchy();
    let reloaded =
        authority::Authority::from_pem(org.cert_pem().as_bytes(), org.key_pem().as_bytes())
            .unwrap();
    let node = authority::create_node(&reloaded, "n", &[], Validity::days(1)).unwrap();
    let trust = TrustStore::from_pem(root.cert_pem().as_bytes(), &[]).unwrap();
    assert!(
        trust
            .verify_peer(identity(&node).chain(), hypha_certs::now())
            .is_ok()
    );
    let err = authority::Authority::from_pem(org.cert_pem().as_bytes(), root.key_pem().as_bytes())
        .unwrap_err();
    assert!(matches!(err, Error::KeyMismatch { .. }), "{err}");
}
