"""The currencies Stripe charges in, as its "Invalid currency" error lists them: billing
validates against this list, and the Stripe emulator answers with it."""

from __future__ import annotations

_CODES = (
    "usd aed afn all amd ang aoa ars aud awg azn bam bbd bdt bgn bhd bif bmd bnd bob brl bsd bwp "
    "byn bzd cad cdf chf clp cny cop crc cve czk djf dkk dop dzd egp etb eur fjd fkp gbp gel gip "
    "gmd gnf gtq gyd hkd hnl htg huf idr ils inr isk jmd jod jpy kes kgs khr kmf krw kwd kyd kzt "
    "lak lbp lkr lrd lsl mad mdl mga mkd mmk mnt mop mur mvr mwk mxn myr mzn nad ngn nio nok npr "
    "nzd omr pab pen pgk php pkr pln pyg qar ron rsd rub rwf sar sbd scr sek sgd shp sle sos srd "
    "std szl thb tjs tnd top try ttd twd tzs uah ugx uyu uzs vnd vuv wst xaf xcd xof xpf yer zar "
    "zmw"
)
STRIPE_CURRENCIES = frozenset(_CODES.split())

# Stripe counts these in whole units: an amount of 1700 jpy is ¥1,700.
ZERO_DECIMAL = frozenset(
    {"bif", "clp", "djf", "gnf", "jpy", "kmf", "krw", "mga", "pyg", "rwf", "ugx", "vnd", "vuv"}
    | {"xaf", "xof", "xpf"}
)
# Amounts in these are in thousandths, but Stripe charges them to the hundredth: the last digit
# must be 0.
THREE_DECIMAL = frozenset({"bhd", "jod", "kwd", "omr", "tnd"})
# Two-decimal in the API, but Stripe takes only whole units (amounts in multiples of 100):
# a fraction is refused with invalid_charge_amount_no_decimal_compatible.
WHOLE_UNITS_ONLY = frozenset({"isk"})
# Stripe's minimum charge per currency, in its smallest unit, as Stripe publishes them for
# charges settled in the same currency (its "Minimum and maximum charge amounts"); below it
# Stripe refuses the charge with amount_too_small. In the others it asks for the equivalent of
# the settlement currency's minimum at the day's rate, which cannot be checked here.
MINIMUM_CHARGE = {
    "usd": 50,
    "aed": 200,
    "aud": 50,
    "bgn": 100,
    "brl": 50,
    "cad": 50,
    "chf": 50,
    "czk": 1500,
    "dkk": 250,
    "eur": 50,
    "gbp": 30,
    "hkd": 400,
    "huf": 17500,
    "inr": 50,
    "jpy": 50,
    "mxn": 1000,
    "myr": 200,
    "nok": 300,
    "nzd": 50,
    "pln": 200,
    "ron": 200,
    "sek": 300,
    "sgd": 50,
    "thb": 1000,
}


def decimal_places(currency: str) -> int:
    """How many of an amount's last digits Stripe's API counts below the currency's unit."""
    if currency in ZERO_DECIMAL:
        return 0
    return 3 if currency in THREE_DECIMAL else 2
