package clustertls

import (
	"crypto/x509"
	"fmt"
	"slices"
	"time"
)

// CredentialCheck is the outcome of one check of CheckMember; Err nil means
// it passed.
type CredentialCheck struct {
	What string
	Err  error
}

// CheckMember checks, without opening a connection, the credentials c
// locates for member at time now: the CA file holds CA certificates, the
// certificate and key load and belong together, the certificate names
// member (CN and DNS SAN, as peers check), is valid at now, and is signed by
// a CA in the CA file for both client and server use, and, with a CRL file, that the file is the CA's and
// does not list the certificate. A check that cannot
// run because an earlier one failed is reported as failed, naming it.
func (c Config) CheckMember(member string, now time.Time) []CredentialCheck {
	pool, caErr := c.loadCAPool()
	checks := []CredentialCheck{{"CA file " + c.CAFile + " holds CA certificates", caErr}}
	pair, pairErr := c.loadKeyPair()
	checks = append(checks, CredentialCheck{"certificate " + c.CertFile + " and key " + c.KeyFile + " load and match", pairErr})
	if pairErr != nil {
		skipped := fmt.Errorf("not checked: fix the certificate and key first")
		return append(checks,
			CredentialCheck{"certificate names member " + member, skipped},
			CredentialCheck{"certificate is valid now", skipped},
			CredentialCheck{"certificate is signed by the cluster CA", skipped})
	}
	leaf := pair.Leaf
	var nameErr error
	switch {
	case ValidateMemberName(member) != nil:
		nameErr = fmt.Errorf("configured name: %w", ValidateMemberName(member))
	case leaf.Subject.CommonName != member:
		nameErr = fmt.Errorf("certificate CN is %q, not %q: issue one for %s (ftctl pki issue %s)", leaf.Subject.CommonName, member, member, member)
	case !slices.Contains(leaf.DNSNames, member):
		nameErr = fmt.Errorf("certificate has no DNS name %q (peers check it): issue one with ftctl pki issue %s", member, member)
	}
	checks = append(checks, CredentialCheck{"certificate names member " + member, nameErr})
	var validErr error
	switch {
	case now.Before(leaf.NotBefore):
		validErr = fmt.Errorf("not valid before %s (is this host's clock right?)", leaf.NotBefore.UTC().Format(time.RFC3339))
	case now.After(leaf.NotAfter):
		validErr = fmt.Errorf("expired %s: issue a new one (ftctl pki issue %s)", leaf.NotAfter.UTC().Format(time.RFC3339), member)
	}
	checks = append(checks, CredentialCheck{"certificate is valid now (until " + leaf.NotAfter.UTC().Format(time.RFC3339) + ")", validErr})
	var signErr error
	var chains [][]*x509.Certificate // the verified chains, for the CRL check
	if caErr != nil {
		signErr = fmt.Errorf("not checked: fix the CA file first")
	} else {
		// Verify at a time inside the leaf's validity: expiry has its own line.
		at := now
		if now.Before(leaf.NotBefore) || now.After(leaf.NotAfter) {
			at = leaf.NotBefore.Add(time.Second)
		}
		inter := x509.NewCertPool()
		for _, der := range pair.Certificate[1:] {
			if cert, err := x509.ParseCertificate(der); err == nil {
				inter.AddCert(cert)
			}
		}
		for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
			verified, err := leaf.Verify(x509.VerifyOptions{Roots: pool, Intermediates: inter, CurrentTime: at, KeyUsages: []x509.ExtKeyUsage{usage}})
			chains = verified
			if err != nil {
				signErr = fmt.Errorf("%w: the certificate must come from the CA in %s (ftctl pki issue with that CA's --dir)", err, c.CAFile)
				break
			}
		}
	}
	checks = append(checks, CredentialCheck{"certificate is signed by the cluster CA", signErr})
	if c.CRLFile == "" {
		return checks
	}
	crlErr := caErr
	if caErr == nil {
		var revoked revocations
		if _, revoked, crlErr = c.loadTrust(); crlErr == nil {
			if len(chains) > 0 {
				crlErr = revoked.checkChains(chains) // a sub-CA of the chain may be the one revoked
			} else {
				crlErr = revoked.check(leaf)
			}
		}
	} else {
		crlErr = fmt.Errorf("not checked: fix the CA file first")
	}
	return append(checks, CredentialCheck{"CRL file " + c.CRLFile + " is signed by the cluster CA and does not revoke this certificate", crlErr})
}
