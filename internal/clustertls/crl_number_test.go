package clustertls

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/pem"
	"math/big"
	"testing"
	"time"
)

// tbsCertList, revokedCert and certList are RFC 5280's TBSCertList, its revoked entries and CertificateList,
// for a list x509.CreateRevocationList cannot make (the pkix types of them are deprecated).
type tbsCertList struct {
	Raw                 asn1.RawContent
	Version             int `asn1:"optional,default:0"`
	Signature           pkix.AlgorithmIdentifier
	Issuer              asn1.RawValue
	ThisUpdate          time.Time
	NextUpdate          time.Time     `asn1:"optional"`
	RevokedCertificates []revokedCert `asn1:"optional"`
}

type revokedCert struct {
	SerialNumber   *big.Int
	RevocationTime time.Time
}

type certList struct {
	TBSCertList        asn1.RawValue
	SignatureAlgorithm pkix.AlgorithmIdentifier
	SignatureValue     asn1.BitString
}

// crlWithoutNumber signs, with ca, a CRL revoking serials that has no CRL number extension, as
// `openssl ca -gencrl` writes without a crlnumber file (x509.CreateRevocationList always adds one).
func crlWithoutNumber(t *testing.T, ca *CA, serials ...int64) []byte {
	t.Helper()
	now := time.Now().UTC().Truncate(time.Second)
	sigAlg := pkix.AlgorithmIdentifier{Algorithm: asn1.ObjectIdentifier{1, 2, 840, 10045, 4, 3, 2}} // ecdsa-with-SHA256
	tbs := tbsCertList{
		Version:    1,
		Signature:  sigAlg,
		Issuer:     asn1.RawValue{FullBytes: ca.cert.RawSubject},
		ThisUpdate: now.Add(-time.Minute),
		NextUpdate: now.Add(time.Hour),
	}
	for _, s := range serials {
		tbs.RevokedCertificates = append(tbs.RevokedCertificates, revokedCert{SerialNumber: big.NewInt(s), RevocationTime: now})
	}
	tbsDER, err := asn1.Marshal(tbs)
	if err != nil {
		t.Fatal(err)
	}
	digest := sha256.Sum256(tbsDER)
	sig, err := ca.key.Sign(rand.Reader, digest[:], nil)
	if err != nil {
		t.Fatal(err)
	}
	der, err := asn1.Marshal(certList{TBSCertList: asn1.RawValue{FullBytes: tbsDER}, SignatureAlgorithm: sigAlg,
		SignatureValue: asn1.BitString{Bytes: sig, BitLength: 8 * len(sig)}})
	if err != nil {
		t.Fatal(err)
	}
	rl, err := x509.ParseRevocationList(der)
	if err != nil || rl.Number != nil || rl.CheckSignatureFrom(ca.cert) != nil {
		t.Fatalf("the hand-made list: %v, number %v", err, rl.Number)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "X509 CRL", Bytes: der})
}

// TestRevokeExtendsListWithoutNumber: a list of the CA without a CRL number (openssl's without a crlnumber
// file; agents accept it) is extended like any other, numbered 1, its entries kept. Revoke panicked on the
// missing number (ftctl pki revoke crashed instead of revoking).
func TestRevokeExtendsListWithoutNumber(t *testing.T) {
	ca := mustCA(t, "cluster")
	prev := crlWithoutNumber(t, ca, 5)
	next, err := ca.Revoke(prev, []*big.Int{big.NewInt(9)}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	lists, err := parseCRLs(next, []*x509.Certificate{ca.cert})
	if err != nil || len(lists) != 1 {
		t.Fatalf("parse: %v (%d lists)", err, len(lists))
	}
	var got []int64
	for _, e := range lists[0].RevokedCertificateEntries {
		got = append(got, e.SerialNumber.Int64())
	}
	if len(got) != 2 || got[0] != 5 || got[1] != 9 || lists[0].Number.Cmp(big.NewInt(1)) != 0 {
		t.Errorf("entries %v number %v; want [5 9] number 1", got, lists[0].Number)
	}
}
