package clustertls

import (
	"bytes"
	"crypto/x509"
	"math/big"
	"testing"
	"time"
)

func fuzzSeeds(f *testing.F) (caCert, caKey, leafCert, leafKey []byte) {
	f.Helper()
	ca := mustCA(f, "cluster")
	leafCert, leafKey, err := ca.Issue("node1", nil, time.Hour)
	if err != nil {
		f.Fatal(err)
	}
	return ca.CertPEM(), ca.KeyPEM(), leafCert, leafKey
}

// FuzzParsePEM feeds arbitrary bytes to the certificate and key decoders that
// read files from disk: they must never panic, and success must mean usable output.
func FuzzParsePEM(f *testing.F) {
	caCert, caKey, leafCert, leafKey := fuzzSeeds(f)
	for _, s := range [][]byte{caCert, caKey, leafCert, leafKey, append(caCert, leafCert...), caCert[:100], []byte("-----BEGIN CERTIFICATE-----\n\n-----END CERTIFICATE-----\n"), nil} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if certs, err := parseCertsPEM(data); err == nil {
			if len(certs) == 0 {
				t.Fatal("parseCertsPEM succeeded with no certificates")
			}
			for _, c := range certs {
				if len(c.Raw) == 0 || c.PublicKey == nil {
					t.Fatal("parsed certificate lacks raw bytes or public key")
				}
			}
		} else if err.Error() == "" {
			t.Fatal("empty error message")
		}
		if key, err := parseKeyPEM(data); err == nil && key.Public() == nil {
			t.Fatal("parsed key has no public half")
		}
	})
}

// FuzzLoadCA checks that LoadCA never panics and that whatever it accepts
// round-trips and can issue certificates.
func FuzzLoadCA(f *testing.F) {
	caCert, caKey, leafCert, leafKey := fuzzSeeds(f)
	f.Add(caCert, caKey)
	f.Add(leafCert, leafKey)
	f.Add(caCert, leafKey)
	f.Add(caCert[:len(caCert)-30], caKey)
	f.Fuzz(func(t *testing.T, certPEM, keyPEM []byte) {
		ca, err := LoadCA(certPEM, keyPEM)
		if err != nil {
			return
		}
		again, err := LoadCA(ca.CertPEM(), ca.KeyPEM())
		if err != nil {
			t.Fatalf("accepted CA does not reload: %v", err)
		}
		if !bytes.Equal(again.CertPEM(), ca.CertPEM()) {
			t.Fatal("CA certificate changed on reload")
		}
	})
}

// FuzzParseCRLs feeds arbitrary bytes to the reader of the CRL file (re-read on every handshake): it must
// never panic, and a file it accepts holds only lists the trusted CA signed, which Revoke extends.
func FuzzParseCRLs(f *testing.F) {
	ca := mustCA(f, "cluster")
	other := mustCA(f, "other")
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	crl, err := ca.Revoke(nil, []*big.Int{big.NewInt(10), big.NewInt(11)}, now)
	if err != nil {
		f.Fatal(err)
	}
	foreign, err := other.Revoke(nil, []*big.Int{big.NewInt(10)}, now)
	if err != nil {
		f.Fatal(err)
	}
	for _, s := range [][]byte{crl, foreign, append(bytes.Clone(crl), crl...), append(bytes.Clone(crl), foreign...), crl[:len(crl)/2], ca.CertPEM(), nil} {
		f.Add(s)
	}
	cas := []*x509.Certificate{ca.cert}
	f.Fuzz(func(t *testing.T, data []byte) {
		lists, err := parseCRLs(data, cas)
		if err != nil {
			return
		}
		if len(lists) == 0 {
			t.Fatal("parseCRLs accepted a file without a list")
		}
		for _, rl := range lists {
			if rl.CheckSignatureFrom(ca.cert) != nil {
				t.Fatal("parseCRLs accepted a list the CA did not sign")
			}
		}
		if len(lists) == 1 {
			if _, err := ca.Revoke(data, []*big.Int{big.NewInt(12)}, now); err != nil {
				t.Fatalf("a list parseCRLs accepts cannot be extended: %v", err)
			}
		}
	})
}
