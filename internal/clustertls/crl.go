package clustertls

import (
	"bytes"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"os"
	"slices"
	"time"
)

// Revocation withdraws a certificate before it expires: an operator's key on a lost laptop, a member
// host stolen or retired. The CA signs a certificate revocation list (X.509 CRL, the form OpenVPN's
// crl-verify and nginx's ssl_crl read); every agent and ftctl --cluster refuses, at the next handshake,
// a peer whose certificate serial it lists. A CRL's NextUpdate is not an expiry here: the list is a file
// the site distributes, authoritative until replaced.

// crlValidity is the NextUpdate a CRL is given (the field is required); see above.
const crlValidity = 10 * 365 * 24 * time.Hour

// maxCRLFile bounds the CRL file read on every handshake (one entry is about 40 bytes).
const maxCRLFile = 8 << 20

// Revoke returns a CRL, PEM-encoded, signed by ca, listing the entries of prev (a CRL of this CA from an
// earlier Revoke, or nil) and serials, revoked at now. Its number is prev's plus one, so the newest list
// is recognisable. A serial already listed keeps its first revocation time.
func (ca *CA) Revoke(prev []byte, serials []*big.Int, now time.Time) ([]byte, error) {
	if len(serials) == 0 {
		return nil, errors.New("revoke: no serial number given")
	}
	var entries []x509.RevocationListEntry
	number := big.NewInt(1)
	if len(prev) > 0 {
		lists, err := parseCRLs(prev, []*x509.Certificate{ca.cert})
		if err != nil {
			return nil, fmt.Errorf("revoke: the existing list: %w", err)
		}
		if len(lists) != 1 {
			return nil, fmt.Errorf("revoke: the existing list holds %d CRLs, expected 1", len(lists))
		}
		entries = lists[0].RevokedCertificateEntries
		// A list made elsewhere (openssl ca -gencrl without a crlnumber file) may have no number: ours is 1.
		if lists[0].Number != nil {
			number.Add(lists[0].Number, big.NewInt(1))
		}
	}
	for _, s := range serials {
		if s == nil || s.Sign() <= 0 {
			return nil, fmt.Errorf("revoke: serial %v: serial numbers are positive", s)
		}
		if !slices.ContainsFunc(entries, func(e x509.RevocationListEntry) bool { return e.SerialNumber.Cmp(s) == 0 }) {
			entries = append(entries, x509.RevocationListEntry{SerialNumber: new(big.Int).Set(s), RevocationTime: now.UTC()})
		}
	}
	der, err := x509.CreateRevocationList(rand.Reader, &x509.RevocationList{
		RevokedCertificateEntries: entries,
		Number:                    number,
		ThisUpdate:                now.Add(-clockSkew),
		NextUpdate:                now.Add(crlValidity),
	}, ca.cert, ca.key)
	if err != nil {
		return nil, fmt.Errorf("revoke: sign the list: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "X509 CRL", Bytes: der}), nil
}

// parseCRLs parses the PEM CRLs in data; each must be signed by one of cas. Anything else in the file,
// or a list no trusted CA signed, is an error: a revocation list nobody can vouch for is refused, not
// ignored.
func parseCRLs(data []byte, cas []*x509.Certificate) ([]*x509.RevocationList, error) {
	var lists []*x509.RevocationList
	for rest := bytes.TrimSpace(data); len(rest) > 0; rest = bytes.TrimSpace(rest) {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			return nil, errors.New("not PEM: expected X509 CRL blocks (ftctl pki revoke writes them)")
		}
		if block.Type != "X509 CRL" {
			return nil, fmt.Errorf("PEM block %q: expected X509 CRL", block.Type)
		}
		rl, err := x509.ParseRevocationList(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("CRL %d: %w", len(lists)+1, err)
		}
		signed := false
		for _, ca := range cas {
			if rl.CheckSignatureFrom(ca) == nil {
				signed = true
				break
			}
		}
		if !signed {
			return nil, fmt.Errorf("CRL %d (issuer %q) is not signed by a CA of the CA file: make it with ftctl pki revoke and that CA's --dir", len(lists)+1, rl.Issuer.CommonName)
		}
		lists = append(lists, rl)
	}
	if len(lists) == 0 {
		return nil, errors.New("no CRL in the file")
	}
	return lists, nil
}

// revocations is what the CRL file lists.
type revocations []*x509.RevocationList

// check refuses leaf if a list of its issuer names its serial.
func (r revocations) check(leaf *x509.Certificate) error {
	for _, rl := range r {
		if !bytes.Equal(rl.RawIssuer, leaf.RawIssuer) {
			continue
		}
		for _, e := range rl.RevokedCertificateEntries {
			if e.SerialNumber.Cmp(leaf.SerialNumber) == 0 {
				return fmt.Errorf("clustertls: certificate %q (serial %x) was revoked at %s; refusing it", leaf.Subject.CommonName, leaf.SerialNumber, e.RevocationTime.UTC().Format(time.RFC3339))
			}
		}
	}
	return nil
}

// checkPeer refuses the verified peer of cs if its certificate is revoked.
func (r revocations) checkPeer(cs *tls.ConnectionState) error {
	if len(r) == 0 {
		return nil
	}
	if len(cs.VerifiedChains) == 0 || len(cs.VerifiedChains[0]) == 0 {
		return errors.New("clustertls: peer has no verified certificate chain")
	}
	return r.checkChains(cs.VerifiedChains)
}

// checkChains refuses a certificate whose every verified chain (leaf first, a CA of the CA file last)
// holds a revoked certificate: the leaf, or a sub-CA between it and the CA file's CA, which the CA's list
// revokes. Checking the leaf alone admitted every certificate of a revoked sub-CA.
func (r revocations) checkChains(chains [][]*x509.Certificate) error {
	var first error
	for _, chain := range chains {
		err := r.checkChain(chain)
		if err == nil {
			return nil
		}
		if first == nil {
			first = err
		}
	}
	return first
}

// checkChain refuses chain if a list revokes one of its certificates but the trust anchor (the last,
// which only the CA file withdraws).
func (r revocations) checkChain(chain []*x509.Certificate) error {
	for _, cert := range chain[:max(len(chain)-1, 1)] {
		if err := r.check(cert); err != nil {
			return err
		}
	}
	return nil
}

// loadRevocations reads c.CRLFile (none: nothing is revoked), checked against the trusted CAs.
func (c Config) loadRevocations(cas []*x509.Certificate) (revocations, error) {
	if c.CRLFile == "" {
		return nil, nil
	}
	f, err := os.Open(c.CRLFile)
	if err != nil {
		return nil, fmt.Errorf("read CRL file: %w", err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxCRLFile+1))
	if err != nil {
		return nil, fmt.Errorf("read CRL file %s: %w", c.CRLFile, err)
	}
	if len(data) > maxCRLFile {
		return nil, fmt.Errorf("CRL file %s is over %d MiB", c.CRLFile, maxCRLFile>>20)
	}
	lists, err := parseCRLs(data, cas)
	if err != nil {
		return nil, fmt.Errorf("CRL file %s: %w", c.CRLFile, err)
	}
	return lists, nil
}
